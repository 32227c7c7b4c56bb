// Backend-independent helpers for comm::Group implementations (defined in group.cpp): the
// argument checks of every op (messages name the op, dtype, shape and device), the store
// prefixes that make a reused group name safe, and the broken-state and flight-recorder dump
// every backend keeps. Gloo and NCCL both use them, so both reject the same arguments.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/flight_recorder.h"
#include "loom/comm/group.h"
#include "loom/comm/store.h"

namespace loom::comm::internal {

// "[2, 3]".
std::string shape_string(const at::Tensor& tensor);
bool is_integral(at::ScalarType dtype);
// "0, 2, 3" with `separator` between the ranks.
std::string rank_list(const std::vector<int>& ranks, const char* separator);

// Throws InvalidArgument unless `tensor` is a defined, contiguous tensor on `device` of a
// supported dtype. `what` names the argument ("tensor", "outputs[2]"); `op` the collective.
void check_tensor(const char* op, const char* what, const at::Tensor& tensor,
                  const at::Device& device = at::Device(at::kCPU));
// Throws InvalidArgument unless both tensors have the same dtype.
void check_same_dtype(const char* op, const char* what, const at::Tensor& tensor,
                      const char* reference_what, const at::Tensor& reference);
// Throws InvalidArgument unless tensor.numel() == expected.
void check_numel(const char* op, const char* what, const at::Tensor& tensor, int64_t expected);
// Throws InvalidArgument unless 0 <= rank < size; `what` names it ("root", "dst").
void check_rank(const char* op, const char* what, int rank, int size);
// kAvg of integers is rejected (InvalidArgument): a truncated mean silently loses information.
void check_reduce_op(const char* op, ReduceOp reduce, at::ScalarType dtype);
// Checks every tensor (check_tensor) and that they share the first one's dtype.
void check_same_dtype_list(const char* op, const std::vector<at::Tensor>& tensors,
                           const at::Device& device = at::Device(at::kCPU));

// Where a backend's ops run: this rank, the group size and the device its tensors must be on.
struct OpPlace {
  int rank = 0;
  int size = 1;
  at::Device device = at::Device(at::kCPU);
};

// The complete argument checks of each Group op, as group.h states them. Each throws
// InvalidArgument before anything is enqueued.
void check_all_reduce(const OpPlace& place, const at::Tensor& tensor, ReduceOp op);
void check_all_reduce_coalesced(const OpPlace& place, const std::vector<at::Tensor>& tensors,
                                ReduceOp op);
void check_reduce_scatter(const OpPlace& place, const at::Tensor& output, const at::Tensor& input,
                          ReduceOp op);
void check_all_gather(const OpPlace& place, const at::Tensor& output, const at::Tensor& input);
void check_all_gather(const OpPlace& place, const std::vector<at::Tensor>& outputs,
                      const at::Tensor& input);
void check_broadcast(const OpPlace& place, const at::Tensor& tensor, int root);
// `op` is "send" or "recv"; peer is dst or src.
void check_send_recv(const OpPlace& place, const char* op, const at::Tensor& tensor, int peer,
                     int tag);
// Checks the ranks of new_subgroup (each a rank of the group, none twice, this rank among
// them) and returns them sorted.
std::vector<int> check_subgroup_ranks(const OpPlace& place, const std::vector<int>& ranks);
// Checks the arguments of new_<backend>_group; `function` names it in messages.
void check_new_group(const char* function, int rank, int size, const std::string& name,
                     std::chrono::milliseconds connect_timeout);

// "<base>#<g>", where g counts this rank's calls with `base` (through the store's counter
// "<base>/creations/rank<r>"). Every rank of a group makes the same number of calls, so they
// agree on the prefix without talking, and a reused group name gets fresh store keys.
std::string fresh_store_prefix(Store& store, const std::string& base, int rank);

// What a group and its Work handles share: identity, the flight recorder, the reason the group
// broke and its dump. Thread safety: every method may be called from any thread.
class GroupState {
 public:
  GroupState(int rank, int size, std::string name, std::filesystem::path dump_dir,
             size_t flight_capacity);

  // Keeps the first reason (the group fails every later op with it); true for that first call.
  bool mark_broken(const std::string& why);
  // Why the group is unusable; empty while it is healthy. A whole string, never a torn one.
  std::string broken_reason() const;
  bool is_broken() const { return !broken_reason().empty(); }
  // Writes <dump_dir>/rank_<rank>.json; returns a sentence for error messages ("" without a
  // dump directory). Never throws: it runs while another error is being reported.
  std::string dump_flight() const noexcept;

  // Constant after construction.
  const int rank;
  const int size;
  const std::string name;
  const std::filesystem::path dump_dir;
  const std::string description;  // "'world' (rank 1 of 4)"
  FlightRecorder recorder;        // thread-safe on its own

 private:
  // State below is protected by mutex_.
  mutable std::mutex mutex_;
  std::string broken_;
};

// Traces (loom/metrics/trace.h): the arguments of a collective's span, recorded when the op
// is issued while tracing: {"group", "sequence", "dtype", "numel", "bytes", "peers"}.
std::string collective_trace_args(const GroupState& state, uint64_t sequence,
                                  const std::string& dtype, int64_t numel,
                                  const std::vector<int>& peers);
// Records the op's span on the calling thread, from `start_us` (when it started running) to
// now; nothing when start_us < 0 (not traced). A failed op's span says so.
void trace_collective(const std::string& op, int64_t start_us, std::string args, bool failed);

// Every rank's `text` as its lines, in rank order: two all-gathers over `group` (the lengths,
// then the bytes padded to the longest), their tensors on `device` (the group's). Collective;
// for the agreement checks of construction and resume, not for a step.
std::vector<std::vector<std::string>> all_gather_lines(Group& group, const std::string& text,
                                                       at::Device device,
                                                       std::chrono::milliseconds timeout);

}  // namespace loom::comm::internal
