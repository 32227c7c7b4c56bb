// Progress output for long-running commands, on stderr: a line redrawn in place on a terminal,
// a line every 10% otherwise (logs, CI).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace loom::cli {

class Progress {
 public:
  // `what` names the work ("tokenizing"), `unit` the counted things ("documents").
  Progress(std::string what, uint64_t total, std::string unit)
      : what_(std::move(what)), unit_(std::move(unit)), total_(total), tty_(isatty(2) != 0) {}

  void update(uint64_t done) {
    const auto now = std::chrono::steady_clock::now();
    const int decile = total_ == 0 ? 10 : static_cast<int>(done * 10 / total_);
    if (tty_ ? now - last_ < std::chrono::milliseconds(100) : decile <= last_decile_) return;
    last_ = now;
    last_decile_ = decile;
    printed_ = done;
    print(done, tty_ ? "\r" : "", tty_ ? "" : "\n");
  }

  // The final line; not repeated when update() already printed it.
  void finish(uint64_t done) {
    if (tty_ || printed_ != done) print(done, tty_ ? "\r" : "", "\n");
  }

 private:
  void print(uint64_t done, const char* prefix, const char* suffix) const {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "%s%s: %llu/%llu %s (%3.0f%%) %.1f s%s", prefix, what_.c_str(),
                 static_cast<unsigned long long>(done), static_cast<unsigned long long>(total_),
                 unit_.c_str(),
                 total_ ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 100.0,
                 seconds, suffix);
    std::fflush(stderr);
  }

  std::string what_, unit_;
  uint64_t total_;
  bool tty_;
  int last_decile_ = -1;
  uint64_t printed_ = UINT64_MAX;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_{};
};

}  // namespace loom::cli
