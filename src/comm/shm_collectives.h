// The intra-node fast path of the CPU backend: the collectives of a group whose ranks share a
// host run through one shared-memory segment instead of loopback TCP. Private to Loom; the Gloo
// group (gloo_group.cpp) uses it for every collective when its ranks are on one host, and keeps
// TCP for send/recv and for groups that span hosts.
//
// The segment holds, per rank, a control block (barrier counter, op signature, pid, a robust
// "alive" mutex) and a slot of slot_bytes; plus one result slot. A collective moves a tensor in
// pieces of a slot: every rank copies its piece into its own slot, a barrier, each rank reduces
// (or copies) the part it owns out of every slot, a barrier, everyone copies out. Each element
// of a reduction is reduced by one rank, in rank order, so every rank gets the same bits, equal
// to the single-process sum in rank order.
//
// Synchronisation is a counter per rank, waited for with a short spin and then a futex, so a
// waiting rank sleeps. Each wait checks, at most every 10 ms: the op's deadline (a Timeout), the
// group broken by another rank (a CommError quoting it), and whether the rank waited for is
// still there: its alive mutex is held by the thread that runs its ops, so a killed process or
// an exited thread shows as EOWNERDEAD (a CommError naming the rank and its pid). Every failure
// marks the segment broken, so the peers fail within 10 ms instead of at their own deadline.
//
// The segment is unlinked as soon as every rank has mapped it: nothing is left in /dev/shm once
// the group is connected, whatever happens to the ranks later. A creator that dies before that
// leaves a segment whose name holds its pid; the next creation on the host removes it.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/comm/store.h"

namespace loom::comm::internal {

// Equal for two ranks exactly when they can share a segment: the kernel's boot id, the hostname,
// and the network and IPC namespaces (ranks in separate network namespaces are treated as
// separate hosts, which is how the multi-node tests run on one machine).
std::string host_identity();

// The names of the segments in /dev/shm that Loom's groups created; a test asserts that none
// remains. Only the ones whose name holds `pid`, unless pid is 0.
std::vector<std::string> shared_memory_segments(int pid = 0);

class ShmCollectives {
 public:
  using Clock = std::chrono::steady_clock;

  // Creates (rank 0) or maps (the others) the group's segment; the name travels through `store`
  // under `prefix`. Collective over the `size` ranks; Timeout naming the missing ranks after
  // `timeout`. `description` names the group in errors, and `group_ranks[r]` the segment's rank
  // r (the ranks of one host in a larger group; empty: r itself).
  static std::unique_ptr<ShmCollectives> connect(Store& store, const std::string& prefix, int rank,
                                                 int size, size_t slot_bytes,
                                                 std::chrono::milliseconds timeout,
                                                 const std::string& description,
                                                 std::vector<int> group_ranks = {});
  ~ShmCollectives();
  ShmCollectives(const ShmCollectives&) = delete;
  ShmCollectives& operator=(const ShmCollectives&) = delete;

  // Called by the thread that will run the ops, before the first: takes this rank's alive
  // mutex. detach() on that thread when it stops: peers waiting for this rank then fail at once.
  void attach();
  void detach();

  // The ops, on the attached thread, one at a time and in the same order on every rank. `tag`
  // is the op's signature (sequence number, op, dtype, size): ranks whose tags differ fail with
  // CommError at once instead of mixing their data. Tensors are contiguous CPU tensors of fp32,
  // fp64, int32, int64 or uint8 for the reductions (kAvg sums; the caller divides), any dtype
  // for the copies. Throw Timeout past the deadline, CommError when a peer died or failed.
  void all_reduce(const at::Tensor& tensor, ReduceOp op, uint64_t tag, Clock::time_point deadline);
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, uint64_t tag,
                      Clock::time_point deadline);
  void all_gather(const at::Tensor& output, const at::Tensor& input, uint64_t tag,
                  Clock::time_point deadline);
  void all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, uint64_t tag,
                  Clock::time_point deadline);
  void broadcast(const at::Tensor& tensor, int root, uint64_t tag, Clock::time_point deadline);
  void barrier(uint64_t tag, Clock::time_point deadline);

  // Marks the segment broken (the first reason wins) and wakes every waiter: the peers' ops,
  // current and later, fail with a CommError quoting `why`. For a failure outside the segment
  // that its peers wait on (the hierarchical all_reduce's step between hosts).
  void break_group(const std::string& why);

  size_t slot_bytes() const { return slot_bytes_; }

  struct Segment;  // the segment's header (shm_collectives.cpp)

 private:
  ShmCollectives(int rank, int size, size_t slot_bytes, void* base, size_t mapped_bytes,
                 std::string description, std::vector<int> group_ranks);
  // How errors name the segment's rank r.
  int named(int r) const { return group_ranks_.empty() ? r : group_ranks_[r]; }

  template <typename T>
  void all_reduce_typed(T* data, int64_t n, ReduceOp op, Clock::time_point deadline);
  template <typename T>
  void reduce_scatter_typed(T* output, const T* input, int64_t n, ReduceOp op,
                            Clock::time_point deadline);

  // outputs[r] <- rank r's n bytes of input.
  void all_gather_bytes(const std::vector<uint8_t*>& outputs, const uint8_t* input, int64_t n,
                        uint64_t tag, Clock::time_point deadline);
  // Publishes this op's tag; checked against every rank's after the op's first barrier.
  void begin(uint64_t tag);
  // A barrier over every rank (the first of an op also compares the tags).
  void sync(Clock::time_point deadline);
  void wait_for(int peer, uint32_t target, Clock::time_point deadline);
  // Throws CommError if the group was broken by a rank, or if `peer` is gone.
  void check_peer(int peer);
  // Marks the segment broken (the first reason wins), wakes every waiter, throws E(why).
  template <typename E>
  [[noreturn]] void fail(const std::string& why);

  uint8_t* slot(int r) const;
  uint8_t* result() const;

  const int rank_;
  const int size_;
  const size_t slot_bytes_;
  void* const base_;
  const size_t mapped_bytes_;
  const std::string description_;
  const std::vector<int> group_ranks_;
  Segment* const segment_;
  const int spins_;   // busy-wait iterations before a wait yields or sleeps
  const int yields_;  // sched_yield()s before a wait sleeps

  // Used by the attached thread only.
  uint32_t generation_ = 0;  // barriers passed
  uint64_t ops_ = 0;         // ops begun: the parity picks the tag word
  bool tags_pending_ = false;
  uint64_t tag_ = 0;
  bool attached_ = false;
};

}  // namespace loom::comm::internal
