// WorkImpl: completion flag, error and condition variable behind every comm::Work.

#include "comm/work.h"

#include <thread>
#include <utility>

#include "loom/error.h"

namespace loom::comm {

WorkImpl::WorkImpl(std::string op, uint64_t sequence, std::string group,
                   std::chrono::milliseconds default_timeout, TimeoutHook on_timeout, Poll poll)
    : op_(std::move(op)),
      sequence_(sequence),
      group_(std::move(group)),
      default_timeout_(default_timeout),
      on_timeout_(std::move(on_timeout)),
      poll_(std::move(poll)) {}

void WorkImpl::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool completed = false;
  std::exception_ptr error;
  if (poll_) {
    // A polled op: spin (yielding) on the backend until it settles or the deadline passes.
    for (;;) {
      poll_once();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        completed = completed_;
        error = error_;
      }
      if (completed || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::yield();
    }
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    completed = done_.wait_until(lock, deadline, [this] { return completed_; });
    error = error_;
  }
  if (!completed) throw_timeout(timeout);
  if (error) std::rethrow_exception(error);
}

void WorkImpl::throw_timeout(std::chrono::milliseconds timeout) const {
  const std::string note = on_timeout_ ? on_timeout_(*this) : "";
  throw Timeout(detail::concat(
      op_, " #", sequence_, " of group ", group_, " did not complete within ", timeout.count(),
      " ms: a peer has not issued it (ranks issued different collectives) or is slow or dead. "
      "The group is now unusable; destroy and rebuild it.",
      note.empty() ? "" : " ", note));
}

bool WorkImpl::is_completed() const {
  poll_once();
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

std::exception_ptr WorkImpl::exception() const {
  poll_once();
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void WorkImpl::poll_once() const {
  if (!poll_) return;
  std::lock_guard<std::mutex> poll_lock(poll_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
  }
  std::optional<std::exception_ptr> outcome = poll_();
  if (outcome) settle(std::move(*outcome));
}

void WorkImpl::settle(std::exception_ptr error) const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
    completed_ = true;
    error_ = std::move(error);
  }
  done_.notify_all();
}

}  // namespace loom::comm
