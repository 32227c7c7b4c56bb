// Process memory, for the metrics line: resident set size now and at its peak.
#pragma once

#include <cstdint>

#include "loom/visibility.h"

namespace loom::metrics {

struct MemoryUsage {
  int64_t rss_bytes = 0;       // VmRSS of /proc/self/status: resident now
  int64_t peak_rss_bytes = 0;  // VmHWM: the most resident so far
};

// Reads /proc/self/status. Where it is missing or has no VmRSS line (not Linux), both are 0.
// Never throws. Costs one small file read (~20 us).
LOOM_API MemoryUsage process_memory();

}  // namespace loom::metrics
