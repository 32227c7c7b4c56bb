// WorkImpl: the Work handle every backend returns. The backend's thread completes it once (with
// or without an error); any thread may wait on it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>

#include "loom/comm/group.h"

namespace loom::comm {

// Thread safety: every method may be called from any thread; complete() is called once.
class WorkImpl final : public Work {
 public:
  // Called when wait() times out, before Timeout is thrown; returns a note for the message
  // (e.g. where the flight recorder was dumped), possibly empty. Must not throw.
  using TimeoutHook = std::function<std::string(const WorkImpl& work)>;

  // `group` describes the group for messages, e.g. "'world' (rank 1 of 4)".
  WorkImpl(std::string op, uint64_t sequence, std::string group,
           std::chrono::milliseconds default_timeout, TimeoutHook on_timeout);

  void wait(std::chrono::milliseconds timeout) override;
  void wait() override { wait(default_timeout_); }
  bool is_completed() const override;
  std::exception_ptr exception() const override;
  uint64_t sequence() const override { return sequence_; }

  const std::string& op() const { return op_; }
  // Marks the op done (null error = success) and wakes every waiter.
  void complete(std::exception_ptr error);

 private:
  // Constant after construction.
  const std::string op_;
  const uint64_t sequence_;
  const std::string group_;
  const std::chrono::milliseconds default_timeout_;
  const TimeoutHook on_timeout_;

  // State below is protected by mutex_; done_ is notified when completed_ becomes true.
  mutable std::mutex mutex_;
  std::condition_variable done_;
  bool completed_ = false;
  std::exception_ptr error_;
};

}  // namespace loom::comm
