// Flight-recorder ops for tests: one op driven to a state, and runs of all_reduces. Shared by
// the recorder's tests (unit/comm) and the diff's (unit/cli).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "loom/comm/flight_recorder.h"

namespace loom::testing {

// Issues one op and drives it to `state`.
inline void add_op(comm::FlightRecorder& recorder, const std::string& op, const std::string& dtype,
                   int64_t numel, std::vector<int> peers, comm::OpState state) {
  uint64_t sequence = recorder.enqueue(op, dtype, numel, std::move(peers));
  if (state != comm::OpState::kEnqueued) recorder.start(sequence);
  if (state == comm::OpState::kCompleted || state == comm::OpState::kFailed)
    recorder.finish(sequence, state);
}

// `count` completed all_reduce float32[1024].
inline void all_reduces(comm::FlightRecorder& recorder, int count,
                        comm::OpState last_state = comm::OpState::kCompleted) {
  for (int i = 0; i < count; ++i) {
    add_op(recorder, "all_reduce", "float32", 1024, {},
           i + 1 == count ? last_state : comm::OpState::kCompleted);
  }
}

}  // namespace loom::testing
