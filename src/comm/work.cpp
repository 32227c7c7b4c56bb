// WorkImpl: completion flag, error and condition variable behind every comm::Work.

#include "comm/work.h"

#include <utility>

#include "loom/error.h"

namespace loom::comm {

WorkImpl::WorkImpl(std::string op, uint64_t sequence, std::string group,
                   std::chrono::milliseconds default_timeout, TimeoutHook on_timeout)
    : op_(std::move(op)),
      sequence_(sequence),
      group_(std::move(group)),
      default_timeout_(default_timeout),
      on_timeout_(std::move(on_timeout)) {}

void WorkImpl::wait(std::chrono::milliseconds timeout) {
  bool completed = false;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    completed = done_.wait_for(lock, timeout, [this] { return completed_; });
    error = error_;
  }
  if (!completed) {
    const std::string note = on_timeout_ ? on_timeout_(*this) : "";
    throw Timeout(detail::concat(
        op_, " #", sequence_, " of group ", group_, " did not complete within ", timeout.count(),
        " ms: a peer has not issued it (ranks issued different collectives) or is slow or dead. "
        "The group is now unusable; destroy and rebuild it.",
        note.empty() ? "" : " ", note));
  }
  if (error) std::rethrow_exception(error);
}

bool WorkImpl::is_completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

std::exception_ptr WorkImpl::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void WorkImpl::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
    completed_ = true;
    error_ = std::move(error);
  }
  done_.notify_all();
}

}  // namespace loom::comm
