// Process memory from /proc/self/status (see memory.h).
#include "loom/metrics/memory.h"

#include <fstream>
#include <sstream>
#include <string>

namespace loom::metrics {

MemoryUsage process_memory() {
  MemoryUsage usage;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    // Lines read "VmRSS:\t  123456 kB".
    auto read_kb = [&line](const char* key, int64_t& out) {
      if (line.rfind(key, 0) != 0) return;
      std::istringstream fields(line.substr(std::char_traits<char>::length(key)));
      int64_t kb = 0;
      if (fields >> kb) out = kb * 1024;
    };
    read_kb("VmRSS:", usage.rss_bytes);
    read_kb("VmHWM:", usage.peak_rss_bytes);
  }
  return usage;
}

}  // namespace loom::metrics
