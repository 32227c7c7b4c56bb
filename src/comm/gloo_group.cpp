// The Gloo backend of comm::Group: CPU collectives over TCP. Bootstrap goes through a
// loom::comm::Store (adapted to gloo's rendezvous::Store); ops run on one worker thread per
// group in issue order; send/recv are posted by that worker and completed by a second thread so
// that an exchange (both ranks send, then recv) does not deadlock. When every rank is on this
// host the collectives run through shared memory instead (shm_collectives.h), on the same worker.

#include "loom/comm/gloo.h"

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "comm/group_internal.h"
#include "comm/reduce_kernels.h"
#include "comm/shm_collectives.h"
#include "comm/work.h"
#include "loom/comm/flight_recorder.h"
#include "loom/error.h"
#include "loom/metrics/trace.h"
#include "util/deadline.h"
#include "util/dtype.h"
#include "util/mix.h"
#include "util/thread_name.h"

namespace loom::comm {
namespace {

using Clock = std::chrono::steady_clock;
using GlooContext = gloo::rendezvous::Context;
using internal::rank_list;
using internal::ShmCollectives;
using std::chrono::milliseconds;

// gloo's collectives put their slot prefix (0x01..0x08) in the top byte of a 64-bit slot;
// send/recv tags get a prefix of their own so they never match a collective's messages.
constexpr uint64_t kSendRecvSlotBase = uint64_t{0x40} << 56;
// Loom's own ring collectives (reduce_scatter) use a third prefix.
constexpr uint64_t kRingSlotBase = uint64_t{0x20} << 56;

// gloo reports an op that ran past its own deadline as an IoException "Timed out waiting ..."
// (or, for a pending send or recv, "Application timeout caused pair closure"): that is a
// Timeout, like a Work wait that passes its deadline first (which of the two fires first is a
// race when both have the op's timeout), not a broken connection.
[[noreturn]] void throw_gloo_error(const char* call, const char* what, const char* file, int line) {
  const std::string where = std::filesystem::path(file).filename().string();
  const std::string message = detail::concat(call, " failed: ", what, " [", where, ":", line, "]");
  if (std::strstr(what, "Timed out") != nullptr ||
      std::strstr(what, "timeout caused pair closure") != nullptr) {
    throw Timeout(message);
  }
  throw CommError(message);
}

}  // namespace
}  // namespace loom::comm

// Runs a statement that calls gloo; gloo's exceptions become loom::CommError naming the call, the
// gloo message (which names the peer's address for connection errors), file and line.
#define LOOM_GLOO_CHECK(statement)                                              \
  do {                                                                          \
    try {                                                                       \
      statement;                                                                \
    } catch (const ::gloo::Exception& e) {                                      \
      ::loom::comm::throw_gloo_error(#statement, e.what(), __FILE__, __LINE__); \
    } catch (const ::gloo::EnforceNotMet& e) {                                  \
      ::loom::comm::throw_gloo_error(#statement, e.what(), __FILE__, __LINE__); \
    }                                                                           \
  } while (0)

namespace loom::comm {
namespace {

// loom::comm::Store seen as gloo's rendezvous store (used only during connectFullMesh).
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(comm::Store& store, milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string value = store_.get(key, timeout_);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    store_.wait(keys, timeout);
  }

 private:
  comm::Store& store_;
  const milliseconds timeout_;
};

// The Gloo tag of a collective: a hash of its sequence number and its signature (op, dtype,
// element count, root). Ranks in step compute the same tag. Ranks out of step (one skipped a
// collective, or issued another op or size) use different tags, so their messages never meet:
// the ops time out cleanly and the flight recorder names the divergence. With the sequence
// number alone, mismatched messages would meet in one slot and Gloo's receive path would
// abort the process ("op.preamble.length <= op.nbytes") on its own thread.
uint32_t collective_tag(uint64_t sequence, const std::string& signature) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the signature, then SplitMix64
  for (unsigned char c : signature) h = (h ^ c) * 1099511628211ull;
  const uint64_t z = util::splitmix64(h, sequence);
  // Gloo builds a collective's slot as (its own prefix << 56) | tag, so any 32-bit tag stays
  // clear of the send/recv slots (kSendRecvSlotBase).
  return static_cast<uint32_t>(z);
}

// --- typed gloo calls ------------------------------------------------------------------------

template <typename T>
gloo::AllreduceOptions::Func reduce_function(ReduceOp op) {
  return reduce_kernel<T>(op);  // kAvg sums; the caller divides afterwards
}

template <typename T>
void allreduce_typed(const std::shared_ptr<gloo::Context>& context, const at::Tensor& tensor,
                     ReduceOp op, uint32_t tag, milliseconds timeout) {
  gloo::AllreduceOptions options(context);
  options.setOutput(static_cast<T*>(tensor.data_ptr()), static_cast<size_t>(tensor.numel()));
  options.setReduceFunction(reduce_function<T>(op));
  options.setTag(tag);
  options.setTimeout(timeout);
  LOOM_GLOO_CHECK(gloo::allreduce(options));
}

// tensor <- op over the tensor of every rank of `context` by gloo's allreduce (kAvg sums).
void allreduce_gloo(const std::shared_ptr<gloo::Context>& context, const at::Tensor& tensor,
                    ReduceOp op, uint32_t tag, milliseconds timeout) {
  switch (tensor.scalar_type()) {
    case at::kFloat:
      allreduce_typed<float>(context, tensor, op, tag, timeout);
      break;
    case at::kDouble:
      allreduce_typed<double>(context, tensor, op, tag, timeout);
      break;
    case at::kInt:
      allreduce_typed<int32_t>(context, tensor, op, tag, timeout);
      break;
    case at::kLong:
      allreduce_typed<int64_t>(context, tensor, op, tag, timeout);
      break;
    case at::kByte:
      allreduce_typed<uint8_t>(context, tensor, op, tag, timeout);
      break;
    default:
      throw InvalidArgument(
          detail::concat("all_reduce: unsupported dtype ", util::dtype_name(tensor.scalar_type())));
  }
}

// The hierarchical all_reduce of a group whose ranks span hosts, some of which hold several.
struct NodeHierarchy {
  std::unique_ptr<ShmCollectives> local;  // this host's ranks; null when it has only this one
  std::shared_ptr<GlooContext> leaders;   // one rank per host; set on this host's leader only
};

// tensor <- op over every rank's tensor, in place. bf16/fp16 accumulate in an fp32 temporary
// (one conversion each way, so sums of many ranks do not lose bits at every step); kAvg is a
// sum divided by the group size, in the accumulation dtype.
// With `shm` (every rank on this host) the reduction runs through shared memory; with `node`
// it runs through shared memory inside each host, over TCP between the hosts' leaders, and
// comes back through shared memory (the sum is then in host order: ranks of one host first).
void allreduce_tensor(const std::shared_ptr<gloo::Context>& context, ShmCollectives* shm,
                      const NodeHierarchy* node, const at::Tensor& tensor, ReduceOp op,
                      uint32_t tag, milliseconds timeout) {
  switch (tensor.scalar_type()) {
    case at::kBFloat16:
    case at::kHalf: {
      const at::Tensor accumulator = tensor.to(at::kFloat);
      allreduce_tensor(context, shm, node, accumulator, op, tag, timeout);
      tensor.copy_(accumulator);
      return;
    }
    default:
      break;
  }
  const auto deadline = Clock::now() + timeout;
  if (shm != nullptr) {
    shm->all_reduce(tensor, op, tag, deadline);
  } else if (node != nullptr) {
    if (node->local != nullptr) node->local->all_reduce(tensor, op, tag, deadline);
    if (node->leaders != nullptr) {
      try {
        allreduce_gloo(node->leaders, tensor, op, tag, util::time_left(deadline));
      } catch (const std::exception& e) {
        // This host's other ranks wait in the broadcast below: fail them now, not at the deadline.
        if (node->local != nullptr) {
          node->local->break_group(
              detail::concat("the host leader's all_reduce between hosts failed: ", e.what()));
        }
        throw;
      }
    }
    if (node->local != nullptr) node->local->broadcast(tensor, 0, tag, deadline);
  } else {
    allreduce_gloo(context, tensor, op, tag, timeout);
  }
  if (op == ReduceOp::kAvg) tensor.div_(context->size);  // integers were rejected at issue
}

size_t nbytes(const at::Tensor& tensor) { return tensor.numel() * tensor.element_size(); }

uint8_t* bytes_of(const at::Tensor& tensor) { return static_cast<uint8_t*>(tensor.data_ptr()); }

void allgather_bytes(const std::shared_ptr<gloo::Context>& context, ShmCollectives* shm,
                     const at::Tensor& input, const at::Tensor& output, uint32_t tag,
                     milliseconds timeout) {
  if (shm != nullptr) {
    shm->all_gather(output, input, tag, Clock::now() + timeout);
    return;
  }
  gloo::AllgatherOptions options(context);
  options.setInput(bytes_of(input), nbytes(input));
  options.setOutput(bytes_of(output), nbytes(output));
  options.setTag(tag);
  options.setTimeout(timeout);
  LOOM_GLOO_CHECK(gloo::allgather(options));
}

// Ring reduce-scatter over gloo's unbound buffers, in W - 1 steps: at step s rank r sends its
// partial result for chunk (r - s - 1) mod W to rank r + 1 and receives the partial result for
// chunk (r - s - 2) mod W from rank r - 1, to which it adds its own input's part. After the
// last step that chunk is r, reduced over every rank. Each rank sends (W - 1) / W of the input
// once: half an all-reduce's traffic. Chunks are shard_range's, so uneven sizes are kept (an
// empty chunk is skipped by both ends alike). The input is only read.
template <typename T>
void reduce_scatter_ring(const std::shared_ptr<gloo::Context>& context, const at::Tensor& input,
                         const at::Tensor& output, ReduceOp op, uint32_t tag,
                         milliseconds timeout) {
  const int world = context->size;
  const int rank = context->rank;
  const int64_t n = input.numel();
  if (world == 1) {
    output.view(-1).copy_(input.view(-1));
    return;
  }
  const Clock::time_point deadline = Clock::now() + timeout;
  auto left = [&] { return util::time_left(deadline); };
  auto chunk = [&](int c) { return shard_range(n, world, ((c % world) + world) % world); };
  const ReduceKernel kernel = reduce_kernel<T>(op);
  const int64_t most = std::max<int64_t>(1, chunk(0).size());
  const at::Tensor received = at::empty({most}, input.options());
  const at::Tensor partial = at::empty({most}, input.options());
  T* in = static_cast<T*>(input.data_ptr());
  T* out = static_cast<T*>(output.data_ptr());
  T* got = static_cast<T*>(received.data_ptr());
  T* mine = static_cast<T*>(partial.data_ptr());
  std::unique_ptr<gloo::transport::UnboundBuffer> input_buffer, received_buffer, partial_buffer;
  LOOM_GLOO_CHECK(input_buffer = context->createUnboundBuffer(in, n * sizeof(T)));
  LOOM_GLOO_CHECK(received_buffer = context->createUnboundBuffer(got, most * sizeof(T)));
  LOOM_GLOO_CHECK(partial_buffer = context->createUnboundBuffer(mine, most * sizeof(T)));
  const uint64_t slot = kRingSlotBase | tag;
  const int next = (rank + 1) % world;
  const int prev = (rank + world - 1) % world;
  for (int step = 0; step < world - 1; ++step) {
    const ShardRange outgoing = chunk(rank - step - 1);
    const ShardRange incoming = chunk(rank - step - 2);
    gloo::transport::UnboundBuffer* sending = step == 0 ? input_buffer.get() : partial_buffer.get();
    const size_t send_offset = step == 0 ? outgoing.begin * sizeof(T) : 0;
    if (incoming.size() > 0) {
      LOOM_GLOO_CHECK(received_buffer->recv(prev, slot, 0, incoming.size() * sizeof(T)));
    }
    if (outgoing.size() > 0) {
      LOOM_GLOO_CHECK(sending->send(next, slot, send_offset, outgoing.size() * sizeof(T)));
    }
    bool done = true;
    if (incoming.size() > 0) LOOM_GLOO_CHECK(done = received_buffer->waitRecv(left()));
    if (done && outgoing.size() > 0) LOOM_GLOO_CHECK(done = sending->waitSend(left()));
    LOOM_CHECK(done, CommError, "reduce_scatter: the group was destroyed during the ring");
    // The chunk received is the next one to send (or, at the last step, this rank's result).
    T* into = step == world - 2 ? out : mine;
    kernel(into, in + incoming.begin, got, static_cast<size_t>(incoming.size()));
  }
}

// output <- this rank's chunk of op over every rank's input. bf16/fp16 run the ring on fp32
// copies (one rounding at the end, as all_reduce); kAvg divides the sum once, at the end.
void reduce_scatter_tensor(const std::shared_ptr<gloo::Context>& context, ShmCollectives* shm,
                           const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                           uint32_t tag, milliseconds timeout) {
  switch (input.scalar_type()) {
    case at::kBFloat16:
    case at::kHalf: {
      const at::Tensor accumulator = at::empty(output.sizes(), output.options().dtype(at::kFloat));
      reduce_scatter_tensor(context, shm, input.to(at::kFloat), accumulator, op, tag, timeout);
      output.copy_(accumulator);
      return;
    }
    default:
      break;
  }
  if (shm != nullptr) {
    shm->reduce_scatter(output, input, op, tag, Clock::now() + timeout);
    if (op == ReduceOp::kAvg) output.div_(context->size);
    return;
  }
  switch (input.scalar_type()) {
    case at::kFloat:
      reduce_scatter_ring<float>(context, input, output, op, tag, timeout);
      break;
    case at::kDouble:
      reduce_scatter_ring<double>(context, input, output, op, tag, timeout);
      break;
    case at::kInt:
      reduce_scatter_ring<int32_t>(context, input, output, op, tag, timeout);
      break;
    case at::kLong:
      reduce_scatter_ring<int64_t>(context, input, output, op, tag, timeout);
      break;
    case at::kByte:
      reduce_scatter_ring<uint8_t>(context, input, output, op, tag, timeout);
      break;
    default:
      throw InvalidArgument(detail::concat("reduce_scatter: unsupported dtype ",
                                           util::dtype_name(input.scalar_type())));
  }
  if (op == ReduceOp::kAvg) output.div_(context->size);
}

// --- bootstrap -----------------------------------------------------------------------------

std::shared_ptr<gloo::transport::Device> make_device(const GlooOptions& options) {
  gloo::transport::tcp::attr attr;
  if (options.interface.empty()) {
    attr.hostname = options.hostname;
  } else {
    attr.iface = options.interface;
  }
  std::shared_ptr<gloo::transport::Device> device;
  try {
    LOOM_GLOO_CHECK(device = gloo::transport::tcp::CreateDevice(attr));
  } catch (const CommError& e) {
    throw CommError(detail::concat("gloo group '", options.name, "': creating the TCP device on ",
                                   options.interface.empty() ? "host '" : "interface '",
                                   options.interface.empty() ? options.hostname : options.interface,
                                   "' failed: ", e.what()));
  }
  return device;
}

// Connects `size` ranks in a full mesh; the addresses travel through `store` under `prefix`.
std::shared_ptr<GlooContext> connect_full_mesh(Store& store, const std::string& prefix, int rank,
                                               int size,
                                               std::shared_ptr<gloo::transport::Device> device,
                                               milliseconds timeout,
                                               const std::string& description) {
  PrefixStore scoped(prefix, store);
  StoreAdapter adapter(scoped, timeout);
  auto context = std::make_shared<GlooContext>(rank, size);
  context->setTimeout(timeout);
  try {
    LOOM_GLOO_CHECK(context->connectFullMesh(adapter, device));
  } catch (const Timeout& e) {
    // gloo publishes each rank's addresses under the key "<rank>".
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (r != rank && !scoped.check({std::to_string(r)})) missing.push_back(r);
    }
    throw Timeout(detail::concat(
        "connecting gloo group ", description, ": rank(s) [", rank_list(missing, ", "),
        "] did not publish their address (store keys '", prefix, "/<rank>') within ",
        timeout.count(), " ms; start every rank with the same group name and world size (",
        e.what(), ")"));
  } catch (const CommError& e) {
    throw CommError(detail::concat("connecting gloo group ", description, ": ", e.what()));
  }
  return context;
}

// The collectives' shared-memory paths, chosen when the group connects from where its ranks
// are: `all` when every rank is on this host, `node` when the ranks span hosts and at least one
// host holds several; neither when the option is off, the group has one rank, or every rank is
// alone on its host.
struct FastPaths {
  std::unique_ptr<ShmCollectives> all;
  std::unique_ptr<NodeHierarchy> node;
};

// Each rank publishes its host identity under `prefix`; all read the same list, so all agree.
// Hosts are numbered in the order of their lowest rank, whose rank leads the host.
FastPaths connect_fast_paths(Store& store, const std::string& prefix, int rank, int size,
                             const std::shared_ptr<gloo::transport::Device>& device,
                             const GlooOptions& options, const std::string& description) {
  if (!options.shared_memory || size == 1) return {};
  PrefixStore scoped(prefix + "/shm", store);
  scoped.set(detail::concat("host/", rank),
             options.host.empty() ? internal::host_identity() : options.host);
  std::vector<std::string> hosts;
  std::vector<int> host_of(size), leaders;  // host index of each rank; each host's lowest rank
  std::vector<std::vector<int>> ranks_of;   // each host's ranks
  for (int r = 0; r < size; ++r) {
    const std::string host = scoped.get(detail::concat("host/", r), options.connect_timeout);
    const auto found = std::find(hosts.begin(), hosts.end(), host);
    host_of[r] = static_cast<int>(found - hosts.begin());
    if (found == hosts.end()) {
      hosts.push_back(host);
      leaders.push_back(r);
      ranks_of.emplace_back();
    }
    ranks_of[host_of[r]].push_back(r);
  }
  FastPaths paths;
  if (hosts.size() == 1) {
    paths.all =
        ShmCollectives::connect(scoped, "segment", rank, size, options.shared_memory_slot_bytes,
                                options.connect_timeout, description);
    return paths;
  }
  if (static_cast<int>(hosts.size()) == size) return paths;  // one rank per host: plain TCP
  const int host = host_of[rank];
  const std::vector<int>& local = ranks_of[host];
  paths.node = std::make_unique<NodeHierarchy>();
  if (local.size() > 1) {
    const int local_rank =
        static_cast<int>(std::find(local.begin(), local.end(), rank) - local.begin());
    paths.node->local = ShmCollectives::connect(
        scoped, detail::concat("node/", host, "/segment"), local_rank,
        static_cast<int>(local.size()), options.shared_memory_slot_bytes, options.connect_timeout,
        detail::concat(description, " (the ranks on host ", host, ": ", rank_list(local, ", "),
                       ")"),
        local);
  }
  if (leaders[host] == rank) {
    paths.node->leaders = connect_full_mesh(
        scoped, "leaders", host, static_cast<int>(hosts.size()), device, options.connect_timeout,
        detail::concat(description, " (host leaders: ranks ", rank_list(leaders, ", "), ")"));
  }
  return paths;
}

// --- the group -------------------------------------------------------------------------------

// What outlives the group for the sake of Work handles (their timeout hook holds a weak_ptr).
using internal::GroupState;

// Thread safety: the public methods are called from one user thread at a time (Group's
// contract); the worker thread and the transfer waiters share state with it only as declared
// below.
class GlooGroup final : public Group {
 public:
  // Connects the group; blocks up to options.connect_timeout. `store` must outlive the group.
  GlooGroup(Store& store, std::string store_prefix, int rank, int size, GlooOptions options,
            std::shared_ptr<gloo::transport::Device> device);
  ~GlooGroup() override;
  GlooGroup(const GlooGroup&) = delete;
  GlooGroup& operator=(const GlooGroup&) = delete;

  int rank() const override { return state_->rank; }
  int size() const override { return state_->size; }
  const std::string& name() const override { return state_->name; }

  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options) override;
  WorkPtr all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                               const AllReduceOptions& options) override;
  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options) override;
  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input,
                     const AllGatherOptions& options) override;
  WorkPtr all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                     const AllGatherOptions& options) override;
  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options) override;
  WorkPtr barrier(const BarrierOptions& options) override;
  WorkPtr send(const at::Tensor& tensor, int dst, const SendRecvOptions& options) override;
  WorkPtr recv(at::Tensor& tensor, int src, const SendRecvOptions& options) override;
  std::unique_ptr<Group> new_subgroup(const std::vector<int>& ranks) override;
  const FlightRecorder& flight_recorder() const override { return state_->recorder; }
  // gloo_transport()'s answer.
  const char* transport() const {
    return fast_.all != nullptr ? "shared memory" : fast_.node != nullptr ? "hierarchical" : "tcp";
  }

 private:
  // A send or recv posted by the worker, waited for on a thread of its own.
  struct Transfer {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    at::Tensor tensor;  // keeps the memory alive while the transfer is pending
    bool is_send = false;
    Clock::time_point deadline;
  };
  struct Op {
    std::shared_ptr<WorkImpl> work;
    std::string label;   // "all_reduce #3 (float32, 7 elements)" for messages
    bool empty = false;  // numel 0: completes without touching the network
    uint32_t tag = 0;    // collective_tag(): the Gloo slot this op's messages use
    // Collectives: runs to completion on the worker thread, given the op's gloo tag.
    std::function<void(uint32_t tag)> run;
    // Send/recv: posts the transfer on the worker thread; a waiter thread waits for it.
    std::function<Transfer()> post;
    // Traces: the span's arguments when issued while tracing, and when it started running.
    std::string trace_args;
    int64_t trace_start_us = -1;
  };
  struct PendingTransfer {
    Op op;
    Transfer transfer;
  };

  // Records the op (dtype "" and numel 0 for barrier) and queues it for the worker.
  WorkPtr enqueue(const char* op, const std::string& dtype, int64_t numel, std::vector<int> peers,
                  milliseconds timeout, Op body);
  WorkPtr enqueue(const char* op, const at::Tensor& tensor, std::vector<int> peers,
                  milliseconds timeout, Op body) {
    return enqueue(op, util::dtype_name(tensor.scalar_type()), tensor.numel(), std::move(peers),
                   timeout, std::move(body));
  }
  void worker_loop();
  // Waits for one posted transfer and completes its op (a waiter thread's body). Each transfer
  // has its own waiter so that transfers complete in any order: a send completes only once its
  // peer posts the matching recv, which the peer may do after waiting for a later transfer of
  // ours (a pipeline's activations one way and gradients the other).
  void wait_transfer(PendingTransfer& pending);
  void run_op(Op& op);
  void finish(Op& op, std::exception_ptr error);
  // Completes op with CommError (or Timeout when timed_out) naming it; marks the group broken.
  void fail(Op& op, const std::string& why, bool timed_out = false);
  // Gloo's tensors live on the CPU.
  internal::OpPlace place() const { return {state_->rank, state_->size, at::Device(at::kCPU)}; }
  WorkPtr post_transfer(const char* op, const at::Tensor& tensor, int peer,
                        const SendRecvOptions& options, bool is_send);

  // Constant after construction.
  Store& store_;  // subgroups bootstrap through it
  const std::string store_prefix_;
  const GlooOptions options_;
  const std::shared_ptr<GroupState> state_;
  const std::shared_ptr<gloo::transport::Device> device_;
  const std::shared_ptr<GlooContext> context_;  // used by the worker and waiter threads only
  // The collectives' shared-memory paths; worker thread only.
  const FastPaths fast_;

  // Called from the user thread only: the count of collectives issued (not sends and recvs,
  // whose number differs between ranks), from which a collective's Gloo tag derives.
  uint64_t collectives_issued_ = 0;

  // State below is protected by mutex_. work_ready_ is notified when queue_ grows or stopping_
  // is set; waiters_done_ when waiters_ drops.
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable waiters_done_;
  std::deque<Op> queue_;
  std::multiset<gloo::transport::UnboundBuffer*> waiting_on_;  // transfers being waited for
  int waiters_ = 0;        // waiter threads alive (they touch this object until they decrement it)
  bool stopping_ = false;  // the destructor runs: fail what has not started, abort waits

  std::thread worker_;  // runs worker_loop; started last, joined by the destructor
};

GlooGroup::GlooGroup(Store& store, std::string store_prefix, int rank, int size,
                     GlooOptions options, std::shared_ptr<gloo::transport::Device> device)
    : store_(store),
      store_prefix_(std::move(store_prefix)),
      options_(std::move(options)),
      state_(std::make_shared<GroupState>(rank, size, options_.name, options_.flight_dump_dir,
                                          options_.flight_capacity)),
      device_(std::move(device)),
      context_(connect_full_mesh(store_, store_prefix_, rank, size, device_,
                                 options_.connect_timeout, state_->description)),
      fast_(connect_fast_paths(store_, store_prefix_, rank, size, device_, options_,
                               state_->description)),
      worker_([this] { worker_loop(); }) {}

GlooGroup::~GlooGroup() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    for (gloo::transport::UnboundBuffer* buffer : waiting_on_) {
      buffer->abortWaitSend();
      buffer->abortWaitRecv();
    }
  }
  work_ready_.notify_all();
  // A collective in flight ends when its peers close their connections or its timeout passes.
  worker_.join();
  // Transfers posted before stopping_ was seen are aborted as they start waiting.
  std::unique_lock<std::mutex> lock(mutex_);
  waiters_done_.wait(lock, [this] { return waiters_ == 0; });
}

WorkPtr GlooGroup::enqueue(const char* op, const std::string& dtype, int64_t numel,
                           std::vector<int> peers, milliseconds timeout, Op body) {
  std::string label_peers = peers.empty() ? "" : ", peer rank " + rank_list(peers, ", ");
  const std::string signature = detail::concat(op, "|", dtype, "|", numel, "|", label_peers);
  const bool traced = metrics::tracing();
  const std::vector<int> traced_peers = traced ? peers : std::vector<int>();
  const uint64_t sequence = state_->recorder.enqueue(op, dtype, numel, std::move(peers));
  if (traced) {
    body.trace_args =
        internal::collective_trace_args(*state_, sequence, dtype, numel, traced_peers);
  }
  // Collectives meet on a tag from their own count, so that a group whose ranks send and
  // receive different numbers of tensors (a pipeline's stages) still matches its collectives.
  body.tag = body.post ? 0 : collective_tag(++collectives_issued_, signature);
  body.label =
      detail::concat(op, " #", sequence, " (",
                     dtype.empty() ? "no data" : detail::concat(dtype, ", ", numel, " elements"),
                     label_peers, ")");
  std::weak_ptr<GroupState> weak_state = state_;
  body.work = std::make_shared<WorkImpl>(
      op, sequence, state_->description, timeout, [weak_state](const WorkImpl& work) {
        const std::shared_ptr<GroupState> state = weak_state.lock();
        if (!state) return std::string();
        // Dumped on every timed-out wait: the state may have moved on since the last dump.
        state->mark_broken(
            detail::concat("a wait on ", work.op(), " #", work.sequence(), " timed out"));
        return state->dump_flight();
      });
  WorkPtr work = body.work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(body));
  }
  work_ready_.notify_one();
  return work;
}

void GlooGroup::worker_loop() {
  util::name_this_thread("comm " + state_->name);
  // This thread runs the shared-memory ops: peers see it alive while it holds the segment.
  struct Attachment {
    ShmCollectives* shm;
    explicit Attachment(ShmCollectives* s) : shm(s) {
      if (shm != nullptr) shm->attach();
    }
    ~Attachment() {
      if (shm != nullptr) shm->detach();
    }
  } attachment(fast_.all.get()), local_attachment(fast_.node ? fast_.node->local.get() : nullptr);
  for (;;) {
    Op op;
    bool destroyed = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
      destroyed = stopping_;
    }
    if (destroyed) {
      fail(op, "the group was destroyed before the op ran");
    } else {
      run_op(op);
    }
  }
}

void GlooGroup::run_op(Op& op) {
  const uint64_t sequence = op.work->sequence();
  state_->recorder.start(sequence);
  if (!op.trace_args.empty()) op.trace_start_us = metrics::trace_now_us();
  const std::string broken = state_->broken_reason();
  if (!broken.empty()) {
    fail(op, detail::concat("not run because the group is broken: ", broken));
    return;
  }
  try {
    if (op.empty) {
      finish(op, nullptr);
    } else if (op.post) {
      Transfer transfer = op.post();
      auto pending =
          std::make_shared<PendingTransfer>(PendingTransfer{std::move(op), std::move(transfer)});
      {
        std::lock_guard<std::mutex> lock(mutex_);
        gloo::transport::UnboundBuffer* buffer = pending->transfer.buffer.get();
        waiting_on_.insert(buffer);
        ++waiters_;
        if (stopping_) {  // the destructor's aborts have run: this wait ends at once
          buffer->abortWaitSend();
          buffer->abortWaitRecv();
        }
      }
      std::thread([this, pending] { wait_transfer(*pending); }).detach();
    } else {
      op.run(op.tag);  // the same on every rank that is in step
      // The op's tensors are released before the Work completes: a caller that drops its
      // references once the Work is done then frees the memory at once (ZeRO-2's staging).
      op.run = nullptr;
      finish(op, nullptr);
    }
  } catch (const Timeout& e) {
    fail(op, e.what(), /*timed_out=*/true);
  } catch (const std::exception& e) {
    fail(op, e.what());
  }
}

void GlooGroup::wait_transfer(PendingTransfer& pending) {
  util::name_this_thread("comm " + state_->name + " p2p");
  gloo::transport::UnboundBuffer* buffer = pending.transfer.buffer.get();
  std::string error;
  bool timed_out = false;
  try {
    const Transfer& transfer = pending.transfer;
    const milliseconds left = util::time_left(transfer.deadline);
    bool done = false;
    LOOM_GLOO_CHECK(done = transfer.is_send ? transfer.buffer->waitSend(left)
                                            : transfer.buffer->waitRecv(left));
    if (!done) error = "the group was destroyed while the transfer was pending";
  } catch (const Timeout& e) {
    error = e.what();
    timed_out = true;
  } catch (const std::exception& e) {
    error = e.what();
  }
  {  // no abort reaches the buffer once it is out of the set; then it goes
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_on_.erase(waiting_on_.find(buffer));
  }
  pending.transfer = Transfer();
  if (error.empty()) {
    finish(pending.op, nullptr);
  } else {
    fail(pending.op, error, timed_out);
  }
  pending.op = Op();
  // Last: the destructor may finish as soon as waiters_ is 0.
  std::lock_guard<std::mutex> lock(mutex_);
  --waiters_;
  waiters_done_.notify_all();
}

void GlooGroup::finish(Op& op, std::exception_ptr error) {
  state_->recorder.finish(op.work->sequence(), error ? OpState::kFailed : OpState::kCompleted);
  internal::trace_collective(op.work->op(), op.trace_start_us, std::move(op.trace_args),
                             error != nullptr);
  op.work->complete(std::move(error));
}

void GlooGroup::fail(Op& op, const std::string& why, bool timed_out) {
  // The first failure dumps the flight recorder; later ones only repeat why.
  const bool first = state_->mark_broken(detail::concat(op.label, " failed: ", why));
  const std::string note = first ? state_->dump_flight() : "";
  const std::string message = detail::concat(op.label, " of gloo group ", state_->description,
                                             timed_out ? " timed out: " : " failed: ", why,
                                             ". The group is unusable; destroy and rebuild it.",
                                             note.empty() ? "" : " ", note);
  finish(op, timed_out ? std::make_exception_ptr(Timeout(message))
                       : std::make_exception_ptr(CommError(message)));
}

// --- the ops -------------------------------------------------------------------------------

WorkPtr GlooGroup::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  internal::check_all_reduce(place(), tensor, options.op);
  Op body;
  body.empty = tensor.numel() == 0;
  body.run = [context = context_, shm = fast_.all.get(), node = fast_.node.get(), tensor,
              op = options.op, timeout = options.timeout](uint32_t tag) {
    allreduce_tensor(context, shm, node, tensor, op, tag, timeout);
  };
  return enqueue("all_reduce", tensor, {}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                                        const AllReduceOptions& options) {
  internal::check_all_reduce_coalesced(place(), tensors, options.op);
  int64_t total = 0;
  for (const at::Tensor& tensor : tensors) total += tensor.numel();
  Op body;
  body.empty = total == 0;
  body.run = [context = context_, shm = fast_.all.get(), node = fast_.node.get(), tensors,
              op = options.op, timeout = options.timeout](uint32_t tag) {
    // One flat copy, one all-reduce, one copy back: fewer, larger messages than one op each.
    std::vector<at::Tensor> flat_views;
    for (const at::Tensor& tensor : tensors) flat_views.push_back(tensor.view(-1));
    const at::Tensor flat = at::cat(flat_views);
    allreduce_tensor(context, shm, node, flat, op, tag, timeout);
    int64_t offset = 0;
    for (const at::Tensor& tensor : tensors) {
      tensor.view(-1).copy_(flat.narrow(0, offset, tensor.numel()));
      offset += tensor.numel();
    }
  };
  // The flight recorder describes the flat buffer.
  return enqueue("all_reduce_coalesced", util::dtype_name(tensors[0].scalar_type()), total, {},
                 options.timeout, std::move(body));
}

WorkPtr GlooGroup::reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) {
  internal::check_reduce_scatter(place(), output, input, options.op);
  Op body;
  body.empty = input.numel() == 0;
  // Gloo has no reduce-scatter for uneven chunks: Loom's ring (reduce_scatter_ring above).
  body.run = [context = context_, shm = fast_.all.get(), output, input, op = options.op,
              timeout = options.timeout](uint32_t tag) {
    reduce_scatter_tensor(context, shm, input, output, op, tag, timeout);
  };
  return enqueue("reduce_scatter", input, {}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::all_gather(at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) {
  internal::check_all_gather(place(), output, input);
  Op body;
  body.empty = input.numel() == 0;
  body.run = [context = context_, shm = fast_.all.get(), output, input, timeout = options.timeout](
                 uint32_t tag) { allgather_bytes(context, shm, input, output, tag, timeout); };
  return enqueue("all_gather", input, {}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              const AllGatherOptions& options) {
  internal::check_all_gather(place(), outputs, input);
  Op body;
  body.empty = input.numel() == 0;
  body.run = [context = context_, shm = fast_.all.get(), outputs, input,
              timeout = options.timeout](uint32_t tag) {
    if (shm != nullptr) {  // straight into the outputs
      shm->all_gather(outputs, input, tag, Clock::now() + timeout);
      return;
    }
    const int64_t n = input.numel();
    const at::Tensor gathered =
        at::empty({n * static_cast<int64_t>(outputs.size())}, input.options());
    allgather_bytes(context, shm, input, gathered, tag, timeout);
    for (size_t r = 0; r < outputs.size(); ++r) {
      outputs[r].view(-1).copy_(gathered.narrow(0, static_cast<int64_t>(r) * n, n));
    }
  };
  return enqueue("all_gather", input, {}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  internal::check_broadcast(place(), tensor, options.root);
  Op body;
  body.empty = tensor.numel() == 0;
  body.run = [context = context_, shm = fast_.all.get(), tensor, root = options.root,
              timeout = options.timeout](uint32_t tag) {
    if (shm != nullptr) {
      shm->broadcast(tensor, root, tag, Clock::now() + timeout);
      return;
    }
    gloo::BroadcastOptions gloo_options(context);
    gloo_options.setOutput(bytes_of(tensor), nbytes(tensor));
    gloo_options.setRoot(root);
    gloo_options.setTag(tag);
    gloo_options.setTimeout(timeout);
    LOOM_GLOO_CHECK(gloo::broadcast(gloo_options));
  };
  return enqueue("broadcast", tensor, {options.root}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::barrier(const BarrierOptions& options) {
  Op body;
  body.run = [context = context_, shm = fast_.all.get(), timeout = options.timeout](uint32_t tag) {
    if (shm != nullptr) {
      shm->barrier(tag, Clock::now() + timeout);
      return;
    }
    gloo::BarrierOptions gloo_options(context);
    gloo_options.setTag(tag);
    gloo_options.setTimeout(timeout);
    LOOM_GLOO_CHECK(gloo::barrier(gloo_options));
  };
  return enqueue("barrier", "", 0, {}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::post_transfer(const char* op, const at::Tensor& tensor, int peer,
                                 const SendRecvOptions& options, bool is_send) {
  internal::check_send_recv(place(), op, tensor, peer, options.tag);
  Op body;
  body.empty = tensor.numel() == 0;
  body.post = [context = context_, tensor, peer, is_send, timeout = options.timeout,
               slot = kSendRecvSlotBase + static_cast<uint64_t>(options.tag)]() {
    Transfer transfer;
    transfer.tensor = tensor;
    transfer.is_send = is_send;
    transfer.deadline = Clock::now() + timeout;
    LOOM_GLOO_CHECK(transfer.buffer =
                        context->createUnboundBuffer(tensor.data_ptr(), nbytes(tensor)));
    if (is_send) {
      LOOM_GLOO_CHECK(transfer.buffer->send(peer, slot));
    } else {
      LOOM_GLOO_CHECK(transfer.buffer->recv(peer, slot));
    }
    return transfer;
  };
  return enqueue(op, tensor, {peer}, options.timeout, std::move(body));
}

WorkPtr GlooGroup::send(const at::Tensor& tensor, int dst, const SendRecvOptions& options) {
  return post_transfer("send", tensor, dst, options, /*is_send=*/true);
}

WorkPtr GlooGroup::recv(at::Tensor& tensor, int src, const SendRecvOptions& options) {
  return post_transfer("recv", tensor, src, options, /*is_send=*/false);
}

std::unique_ptr<Group> GlooGroup::new_subgroup(const std::vector<int>& ranks) {
  const std::vector<int> sorted = internal::check_subgroup_ranks(place(), ranks);
  const std::string listed = "[" + rank_list(sorted, ",") + "]";
  const auto me = std::find(sorted.begin(), sorted.end(), rank());
  // Every member counts its own creations of this rank list, so repeated subgroups of the
  // same ranks get fresh store keys without any coordination.
  const std::string prefix =
      internal::fresh_store_prefix(store_, detail::concat(store_prefix_, "/sub", listed), rank());
  GlooOptions options = options_;
  options.name = detail::concat(name(), "/sub", listed);
  if (!options.flight_dump_dir.empty()) {
    options.flight_dump_dir /= "sub_" + rank_list(sorted, "_");
  }
  return std::make_unique<GlooGroup>(store_, prefix, static_cast<int>(me - sorted.begin()),
                                     static_cast<int>(sorted.size()), std::move(options), device_);
}

}  // namespace

std::unique_ptr<Group> new_gloo_group(Store& store, int rank, int size,
                                      const GlooOptions& options) {
  internal::check_new_group("new_gloo_group", rank, size, options.name, options.connect_timeout);
  // Each rank counts its own creations of a group name: repeated groups (tests, restarts in
  // one process) get fresh store keys, and every rank derives the same prefix.
  return std::make_unique<GlooGroup>(
      store, internal::fresh_store_prefix(store, "gloo/" + options.name, rank), rank, size, options,
      make_device(options));
}

std::string gloo_transport(const Group& group) {
  const auto* gloo = dynamic_cast<const GlooGroup*>(&group);
  if (gloo == nullptr) return "";
  return gloo->transport();
}

}  // namespace loom::comm
