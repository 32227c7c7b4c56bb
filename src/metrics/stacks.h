// Every thread's stack, for the hang watchdog's dump (docs/observability.md, "Hangs"): what a
// rank is doing when no rank makes progress, beyond its phase and its collectives. Private to
// Loom: Runtime writes it to <run_dir>/stacks/rank_<r>.txt on the coordinator's request.
#pragma once

#include <chrono>
#include <string>

namespace loom::metrics {

// Each thread of this process, named (its /proc comm) with its state, and its stack: every
// frame's module and, where the module exports it, its function (demangled) and offset, else
// the offset in the module (for addr2line). Other threads are asked through a real-time signal
// whose handler records their backtrace; a thread that does not answer within `per_thread` (it
// blocks the signal) is listed without a stack. One capture at a time per process (callers
// wait). Never throws: a failure is a line of the text.
std::string thread_stacks(std::chrono::milliseconds per_thread = std::chrono::milliseconds(200));

}  // namespace loom::metrics
