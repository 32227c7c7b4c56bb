// Collectives: comm::Group, the ranks of a job (or a subset of them) that reduce, gather and
// exchange tensors together, and Work, the handle every collective returns.
//
// Every call is asynchronous: it enqueues the op and returns a Work at once. Ops of one group
// run one at a time, in the order they were issued, on the group's own worker thread; send and
// recv are posted in that order too but complete in the background, so two ranks may both send
// and then recv (an exchange) without deadlock. All ranks of a group must issue the same
// collectives in the same order; a rank that issues a different op, or none, makes its peers
// time out, and the flight recorder (flight_recorder.h) names the first sequence number where
// the ranks diverged.
//
// Tensors are used in place: the caller keeps them alive and unmodified until the Work
// completes. CPU tensors, contiguous, of fp32, fp64, bf16, fp16, int32, int64 or uint8;
// bf16/fp16 reductions accumulate in fp32 (one conversion each way). kAvg is the sum divided by
// size(); it is InvalidArgument for integer dtypes. A tensor with no elements is fine for every
// op: the op moves no data but still takes its sequence number. A bad argument (dtype, device,
// layout, element count, rank) is InvalidArgument thrown by the call itself, before anything is
// enqueued. A Group is safe to use from one thread at a time; Work handles may be waited on
// from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/store.h"
#include "loom/visibility.h"

namespace loom::comm {

class FlightRecorder;

inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{std::chrono::minutes(5)};

enum class ReduceOp { kSum, kAvg, kMin, kMax };
LOOM_API const char* to_string(ReduceOp op);

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;  // for wait() with no argument
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
};

struct AllGatherOptions {
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
};

struct BroadcastOptions {
  int root = 0;  // the group rank whose tensor everyone receives
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
};

struct BarrierOptions {
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
};

struct SendRecvOptions {
  int tag = 0;  // matches a send with its recv when several are in flight between two ranks
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
};

// The handle of one enqueued op. wait() is equivalent to:
//   while (!is_completed()) { if (deadline passed) throw Timeout(op, sequence, peers); sleep; }
//   if (exception()) std::rethrow_exception(exception());
// A Timeout from wait() does not cancel the op: the group is then unusable (its peers are
// out of step) and later ops fail with CommError; destroy the group and rebuild it.
class LOOM_API Work {
 public:
  virtual ~Work() = default;
  // Blocks until the op completes, up to timeout; rethrows the op's error (CommError, ...).
  // Timeout names the op, its sequence number and the group.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // Waits up to the timeout given in the op's options.
  virtual void wait() = 0;
  virtual bool is_completed() const = 0;
  // The op's error once completed with one, else null.
  virtual std::exception_ptr exception() const = 0;
  // The op's position in its group's issue order, from 1.
  virtual uint64_t sequence() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// [begin, end) of the elements rank `rank` of `size` owns when n elements are split into
// contiguous chunks of ceil(n / size); the last ranks may get fewer, or none.
struct ShardRange {
  int64_t begin;
  int64_t end;
  int64_t size() const { return end - begin; }
};
LOOM_API ShardRange shard_range(int64_t n, int size, int rank);

class LOOM_API Group {
 public:
  virtual ~Group() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A human-readable name for errors and flight dumps, e.g. "world" or "dp[0,2]".
  virtual const std::string& name() const = 0;

  // tensor <- op over every rank's tensor.
  virtual WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {}) = 0;
  // One all-reduce for many (small) tensors of one dtype through one flat buffer.
  virtual WorkPtr all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                                       const AllReduceOptions& options = {}) = 0;
  // output <- this rank's shard_range(input.numel(), size(), rank()) of op over every rank's
  // input. output.numel() must equal that range's size.
  virtual WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                 const ReduceScatterOptions& options = {}) = 0;
  // output (size() * input.numel() elements) <- every rank's input, in rank order.
  virtual WorkPtr all_gather(at::Tensor& output, const at::Tensor& input,
                             const AllGatherOptions& options = {}) = 0;
  // outputs[r] <- rank r's input; outputs.size() == size(), each like input.
  virtual WorkPtr all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                             const AllGatherOptions& options = {}) = 0;
  virtual WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options = {}) = 0;
  virtual WorkPtr barrier(const BarrierOptions& options = {}) = 0;
  virtual WorkPtr send(const at::Tensor& tensor, int dst, const SendRecvOptions& options = {}) = 0;
  virtual WorkPtr recv(at::Tensor& tensor, int src, const SendRecvOptions& options = {}) = 0;

  // A group of the given ranks of this group (in this group's numbering; this rank must be
  // among them). Collective: every listed rank calls it with the same list, in the same order
  // relative to other ops. Ranks not listed must not call it.
  virtual std::unique_ptr<Group> new_subgroup(const std::vector<int>& ranks) = 0;

  virtual const FlightRecorder& flight_recorder() const = 0;
};

}  // namespace loom::comm
