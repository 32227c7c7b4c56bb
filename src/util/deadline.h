// Loom's one way to turn a deadline into the time a wait may take, and to time a wait. Private
// to Loom.
//
//   const auto deadline = util::deadline_after(timeout);
//   while (!ready()) {
//     if (util::expired(deadline)) throw Timeout(...);
//     work->wait(util::time_left(deadline));
//   }
#pragma once

#include <algorithm>
#include <chrono>

namespace loom::util {

using SteadyClock = std::chrono::steady_clock;

inline SteadyClock::time_point deadline_after(std::chrono::milliseconds timeout) {
  return SteadyClock::now() + timeout;
}

inline bool expired(SteadyClock::time_point deadline) { return SteadyClock::now() >= deadline; }

// The whole milliseconds left until `deadline`, and never less than 1 ms: a wait given it
// still ends once the deadline has passed, and never receives 0, which Gloo reads as "no
// timeout". Loops decide with expired(), not with this.
inline std::chrono::milliseconds time_left(SteadyClock::time_point deadline) {
  return std::max(
      std::chrono::milliseconds(1),
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now()));
}

// Seconds since `start`, for the wait and compute times that stats report.
inline double seconds_since(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

}  // namespace loom::util
