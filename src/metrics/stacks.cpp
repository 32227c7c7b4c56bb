// Every thread's stack (stacks.h): a real-time signal to each thread in turn, whose handler
// writes its backtrace into one slot; symbolized outside the handler.
#include "metrics/stacks.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace loom::metrics {
namespace {

constexpr int kMaxFrames = 64;

// The one slot the handler fills: only the thread named in `target` writes it, so a late
// answer from a thread that timed out cannot corrupt the next thread's.
struct Slot {
  std::atomic<pid_t> target{0};
  std::atomic<bool> done{false};
  void* frames[kMaxFrames];
  int depth = 0;
};
Slot g_slot;

pid_t this_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

void on_stack_signal(int) {
  const int saved = errno;
  if (g_slot.target.load(std::memory_order_acquire) == this_tid()) {
    g_slot.depth = ::backtrace(g_slot.frames, kMaxFrames);
    g_slot.done.store(true, std::memory_order_release);
  }
  errno = saved;
}

std::string read_line(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

// "R", "S", "D", ... from /proc/self/task/<tid>/stat (after the parenthesised name).
std::string state_of(pid_t tid) {
  const std::string stat = read_line(fmt::format("/proc/self/task/{}/stat", tid));
  const size_t close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? "?" : stat.substr(close + 2, 1);
}

std::string demangle(const char* name) {
  int status = 0;
  char* out = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string result = status == 0 && out != nullptr ? out : name;
  std::free(out);
  return result;
}

std::string symbolize(void* const* frames, int depth) {
  std::string out;
  for (int i = 0; i < depth; ++i) {
    Dl_info info{};
    const auto address = reinterpret_cast<uintptr_t>(frames[i]);
    if (::dladdr(frames[i], &info) == 0 || info.dli_fname == nullptr) {
      out += fmt::format("  #{:<2} 0x{:x}\n", i, address);
      continue;
    }
    const std::string module = std::filesystem::path(info.dli_fname).filename().string();
    if (info.dli_sname != nullptr) {
      out += fmt::format("  #{:<2} {} {}+0x{:x}\n", i, module, demangle(info.dli_sname),
                         address - reinterpret_cast<uintptr_t>(info.dli_saddr));
    } else {
      out += fmt::format("  #{:<2} {}+0x{:x}\n", i, module,
                         address - reinterpret_cast<uintptr_t>(info.dli_fbase));
    }
  }
  return out;
}

}  // namespace

std::string thread_stacks(std::chrono::milliseconds per_thread) {
  static std::mutex capture;
  std::lock_guard<std::mutex> lock(capture);
  std::string out;
  try {
    const int signal = SIGRTMIN + 7;
    void* prime[1];
    ::backtrace(prime, 1);  // loads libgcc's unwinder now, not inside a handler
    // Installed once and kept: a thread that blocked the signal and unblocks it after its
    // turn still finds this handler (the default action of a real-time signal would end the
    // process).
    static bool installed = false;
    if (!installed) {
      struct sigaction action {};
      action.sa_handler = on_stack_signal;
      action.sa_flags = SA_RESTART;
      sigemptyset(&action.sa_mask);
      if (::sigaction(signal, &action, nullptr) != 0) {
        return fmt::format("cannot capture the stacks: sigaction: {}\n", std::strerror(errno));
      }
      installed = true;
    }
    std::vector<pid_t> tids;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task", ec)) {
      tids.push_back(static_cast<pid_t>(std::atoi(entry.path().filename().c_str())));
    }
    std::sort(tids.begin(), tids.end());
    out += fmt::format("pid {}, {} threads\n", ::getpid(), tids.size());
    const pid_t self = this_tid();
    for (const pid_t tid : tids) {
      const std::string name = read_line(fmt::format("/proc/self/task/{}/comm", tid));
      out += fmt::format("\nthread {} \"{}\" state {}{}\n", tid, name, state_of(tid),
                         tid == self ? " (this thread, taking the dump)" : "");
      if (tid == self) {
        void* frames[kMaxFrames];
        out += symbolize(frames, ::backtrace(frames, kMaxFrames));
        continue;
      }
      g_slot.done.store(false, std::memory_order_relaxed);
      g_slot.target.store(tid, std::memory_order_release);
      if (::syscall(SYS_tgkill, ::getpid(), tid, signal) != 0) {
        out += "  (exited)\n";
        continue;
      }
      const auto deadline = std::chrono::steady_clock::now() + per_thread;
      while (!g_slot.done.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      g_slot.target.store(0, std::memory_order_release);
      if (!g_slot.done.load(std::memory_order_acquire)) {
        out += "  (no answer: the thread blocks the signal or is stopped)\n";
        continue;
      }
      // The first two frames are the handler and the kernel's signal trampoline.
      out += symbolize(g_slot.frames + std::min(2, g_slot.depth), std::max(0, g_slot.depth - 2));
    }
    // A late answer finds target 0 and writes nothing.
  } catch (const std::exception& e) {
    out += fmt::format("cannot capture the stacks: {}\n", e.what());
  }
  return out;
}

}  // namespace loom::metrics
