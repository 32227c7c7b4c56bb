// WorkImpl: the Work handle every backend returns. Either the backend's thread completes it once
// (with or without an error: Gloo), or the handle polls the backend for the outcome (a CUDA event
// and the communicator's error: NCCL). Any thread may wait on it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "loom/comm/group.h"

namespace loom::comm {

// Thread safety: every method may be called from any thread; complete() is called once.
class WorkImpl final : public Work {
 public:
  // Called when wait() times out, before Timeout is thrown; returns a note for the message
  // (e.g. where the flight recorder was dumped), possibly empty. Must not throw.
  using TimeoutHook = std::function<std::string(const WorkImpl& work)>;

  // Asks the backend whether the op has finished: nullopt while it runs, else its outcome (a
  // null exception_ptr for success). WorkImpl runs it on the waiting thread, one call at a
  // time, and never again once it returned an outcome. Must not throw.
  using Poll = std::function<std::optional<std::exception_ptr>()>;

  // `group` describes the group for messages, e.g. "'world' (rank 1 of 4)". Without `poll` the
  // backend calls complete(); with it, wait(), is_completed() and exception() poll.
  WorkImpl(std::string op, uint64_t sequence, std::string group,
           std::chrono::milliseconds default_timeout, TimeoutHook on_timeout, Poll poll = nullptr);

  void wait(std::chrono::milliseconds timeout) override;
  void wait() override { wait(default_timeout_); }
  bool is_completed() const override;
  std::exception_ptr exception() const override;
  uint64_t sequence() const override { return sequence_; }

  const std::string& op() const { return op_; }
  const std::string& group() const { return group_; }
  // Marks the op done (null error = success) and wakes every waiter; later calls do nothing.
  void complete(std::exception_ptr error) { settle(std::move(error)); }

 private:
  // Constant after construction.
  const std::string op_;
  const uint64_t sequence_;
  const std::string group_;
  const std::chrono::milliseconds default_timeout_;
  const TimeoutHook on_timeout_;
  const Poll poll_;

  // Runs poll_ once unless the op is done (serialised by poll_mutex_).
  void poll_once() const;
  void settle(std::exception_ptr error) const;
  [[noreturn]] void throw_timeout(std::chrono::milliseconds timeout) const;

  // Serialises calls of poll_; taken before mutex_, never while holding it.
  mutable std::mutex poll_mutex_;
  // State below is protected by mutex_; done_ is notified when completed_ becomes true. Mutable
  // because is_completed() const may settle a polled op.
  mutable std::mutex mutex_;
  mutable std::condition_variable done_;
  mutable bool completed_ = false;
  mutable std::exception_ptr error_;
};

}  // namespace loom::comm
