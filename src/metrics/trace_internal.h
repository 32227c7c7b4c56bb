// The trace recorder's private side (the public API is loom/metrics/trace.h): the step the
// StepTimer names its step span after, and the clock-offset exchange over a Store.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "loom/metrics/trace.h"

namespace loom::comm {
class Store;
}

namespace loom::metrics::internal {

// The step StepTracer::begin_step saw last (-1 before any).
int64_t traced_step();

// This rank's clock against rank 0's (trace.h), measured over `store` under `prefix` (every
// rank passes the same): each rank r > 0 in turn sends `rounds` pings that rank 0 answers with
// its clock; the answer with the smallest round trip gives the offset. Collective; rank 0
// gets {0, 0}. Timeout names the missing key.
ClockOffset measure_clock_offset(comm::Store& store, const std::string& prefix, int rank, int size,
                                 int rounds, std::chrono::milliseconds timeout);

}  // namespace loom::metrics::internal
