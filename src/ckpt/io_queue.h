// I/O threads for the checkpointer: the thread that hashes (the writer thread at save, the
// loading thread at load) hands positional writes and reads to them and goes on hashing and
// copying, so that the device always has requests in flight. Private to Loom.
//
//   IoQueue io(2);
//   for (each 8 MiB block) { hash(block); io.submit([&] { write_all_at(file, ...); }); }
//   io.drain();  // every write done; raises the first failure
//
// Why threads and not io_uring: on the development VM (virtio disk, 2 vCPUs) io_uring at depth
// 2-4 and two threads calling pwrite gave the same throughput (docs/checkpoint.md), and threads
// keep every write and read a call of the Storage seam, where tests inject faults.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace loom::ckpt {

// Thread safety: submit(), wait() and drain() are called by one thread (the owner); the
// operations run on the queue's threads, at most `threads` at once, started in submission
// order. The destructor waits for every submitted operation and discards their failures.
class IoQueue {
 public:
  using Ticket = uint64_t;

  explicit IoQueue(int threads);
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Queues op and returns its ticket. Blocks while `threads` operations are unfinished, so the
  // owner never runs more than that many ahead. Raises, without queueing op, the first failure
  // of an earlier operation that wait() or drain() has not raised yet (the owner stops early).
  Ticket submit(std::function<void()> op);
  // Blocks until operation `ticket` finished; raises its exception if it threw.
  void wait(Ticket ticket);
  // Blocks until every submitted operation finished; raises the first failure not raised yet,
  // and forgets the others (the queue is then ready for new work).
  void drain();
  // drain() that never raises (unwinding).
  void drain_quietly() noexcept;

  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void work();
  // The first failure not raised yet, taken out of failures_; null when none. Holds mutex_.
  std::exception_ptr take_failure();

  // State below is protected by mutex_; changed_ is notified when an operation is queued, one
  // finishes, or stop_ is set.
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<Ticket, std::function<void()>> queued_;  // not started, by ticket
  std::set<Ticket> unfinished_;                     // queued or running
  std::map<Ticket, std::exception_ptr> failures_;   // finished with an exception, not raised
  Ticket next_ = 0;
  bool stop_ = false;

  std::vector<std::thread> workers_;  // started last in the constructor
};

}  // namespace loom::ckpt
