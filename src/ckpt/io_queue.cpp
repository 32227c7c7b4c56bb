// I/O threads for the checkpointer (see io_queue.h).
#include "ckpt/io_queue.h"

#include "loom/error.h"
#include "util/thread_name.h"

namespace loom::ckpt {

IoQueue::IoQueue(int threads) {
  LOOM_CHECK(threads > 0, InvalidArgument, "IoQueue: threads must be positive, got ", threads);
  for (int i = 0; i < threads; ++i)
    workers_.emplace_back([this] {
      util::name_this_thread("ckpt io");
      work();
    });
}

IoQueue::~IoQueue() {
  drain_quietly();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  for (auto& w : workers_) w.join();
}

void IoQueue::work() {
  while (true) {
    std::function<void()> op;
    Ticket ticket;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || !queued_.empty(); });
      if (queued_.empty()) return;
      auto first = queued_.begin();
      ticket = first->first;
      op = std::move(first->second);
      queued_.erase(first);
    }
    std::exception_ptr failure;
    try {
      op();
    } catch (...) {
      failure = std::current_exception();
    }
    op = nullptr;  // release what it captured before the owner learns it finished
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure) failures_.emplace(ticket, std::move(failure));
      unfinished_.erase(ticket);
    }
    changed_.notify_all();
  }
}

std::exception_ptr IoQueue::take_failure() {
  if (failures_.empty()) return nullptr;
  std::exception_ptr first = std::move(failures_.begin()->second);
  failures_.erase(failures_.begin());
  return first;
}

IoQueue::Ticket IoQueue::submit(std::function<void()> op) {
  Ticket ticket;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return unfinished_.size() < workers_.size(); });
    if (std::exception_ptr failure = take_failure()) std::rethrow_exception(failure);
    ticket = next_++;
    queued_.emplace(ticket, std::move(op));
    unfinished_.insert(ticket);
  }
  changed_.notify_all();
  return ticket;
}

void IoQueue::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return unfinished_.count(ticket) == 0; });
  auto it = failures_.find(ticket);
  if (it == failures_.end()) return;
  std::exception_ptr failure = std::move(it->second);
  failures_.erase(it);
  std::rethrow_exception(failure);
}

void IoQueue::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return unfinished_.empty(); });
  std::exception_ptr failure = take_failure();
  failures_.clear();
  if (failure) std::rethrow_exception(failure);
}

void IoQueue::drain_quietly() noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return unfinished_.empty(); });
  failures_.clear();
}

}  // namespace loom::ckpt
