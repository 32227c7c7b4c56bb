// The NCCL backend (see loom/comm/nccl.h). Compiled only with CUDA.
//
// Ordering: an op records an event on the caller's compute stream, makes the group's stream
// wait for it, enqueues the NCCL call (and any copies) on the group's stream and records a
// `done` event there. Work::wait() polls `done` and the communicator's async error against the
// deadline (WorkImpl's polled mode, the completion and timeout path Gloo uses too), then makes
// the compute stream wait for `done`. Every tensor an op touches is held until `done` fired.
// Argument checks, store prefixes, the broken state and the flight-recorder dump are the
// backend-independent ones of group_internal.h.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "comm/cuda_check.h"
#include "comm/cuda_stream.h"
#include "comm/group_internal.h"
#include "comm/work.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/nccl.h"
#include "loom/metrics/trace.h"
#include "util/dtype.h"

namespace loom::comm {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      throw InvalidArgument(detail::concat("NCCL collectives do not support dtype ", type,
                                           ": use float32, float64, bfloat16, float16, int32, "
                                           "int64 or uint8"));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
  }
  throw InvalidArgument("unknown ReduceOp");
}

// Owns one CUDA event.
class Event {
 public:
  Event() { LOOM_CHECK_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// What a group and its Work handles share. Thread safety: any thread may call every method
// (a Work may be waited on from any thread while the user thread issues the next op).
class Comm {
 public:
  Comm(int rank, int size, const NcclOptions& options)
      : state(rank, size, options.name, options.flight_dump_dir, options.flight_capacity),
        device(options.device) {}
  ~Comm() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // Creates the stream and the non-blocking communicator; polls it up to `deadline`.
  void init(const ncclUniqueId& id, Clock::time_point deadline) {
    LOOM_CHECK_CUDA(cudaSetDevice(device));
    LOOM_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      LOOM_CHECK_NCCL(ncclCommInitRankConfig(&comm_, state.size, id, state.rank, &config));
    }
    settle(deadline, "communicator initialisation");
  }

  // Runs call(comm) holding the communicator; throws CommError if the group is broken.
  template <typename Call>
  void with_comm(Call call) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr) throw CommError(unusable());
    call(comm_);
  }

  // The communicator's asynchronous state: ncclSuccess, ncclInProgress or its error
  // (ncclInvalidUsage once it was aborted).
  ncclResult_t async_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr) return ncclInvalidUsage;
    ncclResult_t result = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) return ncclSystemError;
    return result;
  }

  // Polls a non-blocking communicator until its last call finished; fails it at the deadline.
  void settle(Clock::time_point deadline, const std::string& what) {
    while (true) {
      const ncclResult_t result = async_error();
      if (result == ncclSuccess) return;
      if (result != ncclInProgress) {
        fail(detail::concat(what, " failed: ", ncclGetErrorString(result)));
        throw CommError(unusable());
      }
      if (Clock::now() > deadline) {
        fail(detail::concat(what, " did not finish before its deadline"));
        throw Timeout(unusable());
      }
      std::this_thread::yield();
    }
  }

  // Breaks the group: the first reason is kept (whole, under the state's lock), the
  // communicator aborted and the flight recorder dumped. Returns the dump's sentence for the
  // first failure, "" for later ones.
  std::string fail(const std::string& reason) {
    if (!state.mark_broken(reason)) return "";
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    return state.dump_flight();
  }

  // "NCCL group 'world' (rank 1 of 4) is unusable: <reason>; destroy and rebuild it."
  std::string unusable() const {
    return detail::concat("NCCL group ", state.description, " is unusable: ", state.broken_reason(),
                          "; destroy and rebuild it");
  }

  // Constant after construction (stream: once init() returned).
  internal::GroupState state;
  const int device;
  cudaStream_t stream = nullptr;

 private:
  // State below is protected by mutex_: every NCCL call on the communicator, and its abort,
  // hold it, so no call ever sees a communicator that another thread is aborting.
  std::mutex mutex_;
  ncclComm_t comm_ = nullptr;  // null before init() and once aborted
};

// One enqueued op: its `done` event on the group's stream and the tensors it uses, kept alive
// until the event has fired.
struct PendingOp {
  Event done;
  std::vector<at::Tensor> tensors;
  // Traces: an op issued while tracing is a span from its launch to the poll that saw it done
  // (host time, an upper bound of the device's), with its arguments.
  std::string op;
  std::string trace_args;
  int64_t trace_start_us = -1;
};

// The Work of an op: a polled WorkImpl (Loom's shared completion and timeout path), plus the
// compute stream's wait for `done` once the op has succeeded.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<WorkImpl> impl, std::shared_ptr<PendingOp> op, int device)
      : impl_(std::move(impl)), op_(std::move(op)), device_(device) {}

  void wait(std::chrono::milliseconds timeout) override {
    impl_->wait(timeout);
    order_compute_stream();
  }
  void wait() override {
    impl_->wait();
    order_compute_stream();
  }
  bool is_completed() const override { return impl_->is_completed(); }
  std::exception_ptr exception() const override { return impl_->exception(); }
  uint64_t sequence() const override { return impl_->sequence(); }

 private:
  // Later work on the caller's stream sees the result.
  void order_compute_stream() {
    LOOM_CHECK_CUDA(cudaStreamWaitEvent(current_compute_stream(device_), op_->done.get(), 0));
  }

  // Constant after construction.
  const std::shared_ptr<WorkImpl> impl_;
  const std::shared_ptr<PendingOp> op_;
  const int device_;
};

// The poll of an op's Work: done when its event fired, failed when the event reports an error,
// the communicator reports one, or the group broke meanwhile.
WorkImpl::Poll poll_op(std::shared_ptr<Comm> comm, std::shared_ptr<PendingOp> op, uint64_t sequence,
                       std::string label) {
  return [comm = std::move(comm), op = std::move(op), sequence,
          label = std::move(label)]() -> std::optional<std::exception_ptr> {
    const cudaError_t event = cudaEventQuery(op->done.get());
    std::string why;
    if (event == cudaSuccess) {
      comm->state.recorder.finish(sequence, OpState::kCompleted);
      internal::trace_collective(op->op, op->trace_start_us, op->trace_args, false);
      op->tensors.clear();
      return std::exception_ptr();
    }
    if (event != cudaErrorNotReady) {
      why = cudaGetErrorString(event);
    } else if (comm->state.is_broken()) {
      why = "the group broke while it ran";
    } else {
      const ncclResult_t result = comm->async_error();
      if (result == ncclSuccess || result == ncclInProgress) return std::nullopt;
      why = ncclGetErrorString(result);
    }
    const std::string note = comm->fail(detail::concat(label, " failed: ", why));
    comm->state.recorder.finish(sequence, OpState::kFailed);
    internal::trace_collective(op->op, op->trace_start_us, op->trace_args, true);
    return std::make_exception_ptr(CommError(detail::concat(
        label, " of NCCL group ", comm->state.description, " failed: ", why,
        ". The group is unusable; destroy and rebuild it.", note.empty() ? "" : " ", note)));
  };
}

std::string describe(const char* op, const at::Tensor& t) {
  return detail::concat(op, " (", util::dtype_name(t.scalar_type()), ", ", t.numel(), " elements)");
}

class NcclGroup final : public Group {
 public:
  // Connects the group through `store` (keys under `store_prefix`); blocks up to
  // options.connect_timeout. `store` must outlive the group.
  NcclGroup(Store& store, std::string store_prefix, int rank, int size, NcclOptions options)
      : store_(store),
        store_prefix_(std::move(store_prefix)),
        options_(std::move(options)),
        comm_(std::make_shared<Comm>(rank, size, options_)) {
    ncclUniqueId id;
    PrefixStore scoped(store_prefix_, store);
    if (rank == 0) {
      LOOM_CHECK_NCCL(ncclGetUniqueId(&id));
      scoped.set("unique_id", std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    } else {
      std::string bytes = scoped.get("unique_id", options_.connect_timeout);
      LOOM_CHECK(bytes.size() == sizeof(id), CorruptData, "NCCL group ", comm_->state.description,
                 ": the unique id under '", store_prefix_, "/unique_id' has ", bytes.size(),
                 " bytes, expected ", sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    comm_->init(id, Clock::now() + options_.connect_timeout);
    barrier_buffer_ =
        at::zeros({1}, at::TensorOptions()
                           .dtype(at::kFloat)
                           .device(at::kCUDA, static_cast<c10::DeviceIndex>(options_.device)));
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int rank() const override { return comm_->state.rank; }
  int size() const override { return comm_->state.size; }
  const std::string& name() const override { return comm_->state.name; }
  const FlightRecorder& flight_recorder() const override { return comm_->state.recorder; }

  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options) override {
    internal::check_all_reduce(place(), tensor, options.op);
    return launch("all_reduce", tensor, {}, {tensor}, options.timeout,
                  [&](ncclComm_t comm, cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(),
                                                  tensor.numel(), nccl_dtype(tensor.scalar_type()),
                                                  nccl_op(options.op), comm, s));
                  });
  }

  WorkPtr all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                               const AllReduceOptions& options) override {
    internal::check_all_reduce_coalesced(place(), tensors, options.op);
    std::vector<at::Tensor> flat_views;
    for (auto& t : tensors) flat_views.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_views);  // on the compute stream, before `ready`
    std::vector<at::Tensor> keep = tensors;
    keep.push_back(flat);
    return launch("all_reduce_coalesced", flat, {}, keep, options.timeout,
                  [&](ncclComm_t comm, cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclAllReduce(flat.data_ptr(), flat.data_ptr(), flat.numel(),
                                                  nccl_dtype(flat.scalar_type()),
                                                  nccl_op(options.op), comm, s));
                    int64_t offset = 0;
                    for (auto& t : tensors) {
                      copy_async(t, flat, offset, s);
                      offset += t.numel();
                    }
                  });
  }

  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options) override {
    internal::check_reduce_scatter(place(), output, input, options.op);
    // NCCL splits evenly: pad the input to size() chunks of ceil(n / size()).
    const int64_t chunk = (input.numel() + size() - 1) / size();
    at::Tensor padded = input.reshape({-1});
    if (chunk * size() != input.numel()) {
      padded = at::zeros({chunk * size()}, input.options());
      padded.slice(0, 0, input.numel()).copy_(input.reshape({-1}));
    }
    at::Tensor result = output.numel() == chunk ? output : at::empty({chunk}, output.options());
    return launch("reduce_scatter", input, {}, {output, padded, result}, options.timeout,
                  [&](ncclComm_t comm, cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclReduceScatter(padded.data_ptr(), result.data_ptr(), chunk,
                                                      nccl_dtype(input.scalar_type()),
                                                      nccl_op(options.op), comm, s));
                    if (!result.is_same(output)) copy_async(output, result, 0, s);
                  });
  }

  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input,
                     const AllGatherOptions& options) override {
    internal::check_all_gather(place(), output, input);
    return launch(
        "all_gather", input, {}, {output, input}, options.timeout,
        [&](ncclComm_t comm, cudaStream_t s) {
          LOOM_CHECK_NCCL(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                                        nccl_dtype(input.scalar_type()), comm, s));
        });
  }

  WorkPtr all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                     const AllGatherOptions& options) override {
    internal::check_all_gather(place(), outputs, input);
    at::Tensor flat = at::empty({input.numel() * size()}, input.options());
    std::vector<at::Tensor> keep = outputs;
    keep.push_back(flat);
    keep.push_back(input);
    return launch("all_gather", input, {}, keep, options.timeout,
                  [&](ncclComm_t comm, cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclAllGather(input.data_ptr(), flat.data_ptr(), input.numel(),
                                                  nccl_dtype(input.scalar_type()), comm, s));
                    for (int r = 0; r < size(); ++r) {
                      copy_async(outputs[r], flat, r * input.numel(), s);
                    }
                  });
  }

  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options) override {
    internal::check_broadcast(place(), tensor, options.root);
    return launch(
        "broadcast", tensor, {options.root}, {tensor}, options.timeout,
        [&](ncclComm_t comm, cudaStream_t s) {
          LOOM_CHECK_NCCL(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                        nccl_dtype(tensor.scalar_type()), options.root, comm, s));
        });
  }

  WorkPtr barrier(const BarrierOptions& options) override {
    return all_reduce(barrier_buffer_, {.op = ReduceOp::kSum, .timeout = options.timeout});
  }

  // NCCL has no tags (the tag is checked, then unused): sends and receives between two ranks
  // match in issue order.
  WorkPtr send(const at::Tensor& tensor, int dst, const SendRecvOptions& options) override {
    internal::check_send_recv(place(), "send", tensor, dst, options.tag);
    return launch("send", tensor, {dst}, {tensor}, options.timeout,
                  [&](ncclComm_t comm, cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclSend(tensor.data_ptr(), tensor.numel(),
                                             nccl_dtype(tensor.scalar_type()), dst, comm, s));
                  });
  }

  WorkPtr recv(at::Tensor& tensor, int src, const SendRecvOptions& options) override {
    internal::check_send_recv(place(), "recv", tensor, src, options.tag);
    return launch("recv", tensor, {src}, {tensor}, options.timeout,
                  [&](ncclComm_t comm, cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclRecv(tensor.data_ptr(), tensor.numel(),
                                             nccl_dtype(tensor.scalar_type()), src, comm, s));
                  });
  }

  // The lowest listed rank makes a unique id for the subset and shares it through the store.
  std::unique_ptr<Group> new_subgroup(const std::vector<int>& ranks) override {
    const std::vector<int> sorted = internal::check_subgroup_ranks(place(), ranks);
    const std::string listed = "[" + internal::rank_list(sorted, ",") + "]";
    const auto me = std::find(sorted.begin(), sorted.end(), rank());
    // As Gloo: every member counts its own creations of this rank list, so a repeated
    // subgroup of the same ranks gets fresh store keys.
    const std::string prefix =
        internal::fresh_store_prefix(store_, detail::concat(store_prefix_, "/sub", listed), rank());
    NcclOptions sub = options_;
    sub.name = detail::concat(name(), "/sub", listed);
    if (!sub.flight_dump_dir.empty()) {
      sub.flight_dump_dir /= "sub_" + internal::rank_list(sorted, "_");
    }
    return std::make_unique<NcclGroup>(store_, prefix, static_cast<int>(me - sorted.begin()),
                                       static_cast<int>(sorted.size()), std::move(sub));
  }

 private:
  internal::OpPlace place() const {
    return {rank(), size(), at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(options_.device))};
  }

  // dst <- src[offset, offset + dst.numel()) on stream s.
  static void copy_async(at::Tensor& dst, const at::Tensor& src, int64_t offset, cudaStream_t s) {
    size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
    if (bytes == 0) return;
    const char* from = static_cast<const char*>(src.data_ptr()) + offset * src.element_size();
    LOOM_CHECK_CUDA(cudaMemcpyAsync(dst.data_ptr(), from, bytes, cudaMemcpyDeviceToDevice, s));
  }

  // Records the op, orders the group's stream after the compute stream, enqueues body(comm,
  // stream), records `done` and returns the polled Work. A failure to enqueue breaks the group.
  template <typename Body>
  WorkPtr launch(const char* op, const at::Tensor& main, std::vector<int> peers,
                 std::vector<at::Tensor> keep, std::chrono::milliseconds timeout, Body body) {
    if (comm_->state.is_broken()) throw CommError(comm_->unusable());
    const bool traced = metrics::tracing();
    const std::vector<int> traced_peers = traced ? peers : std::vector<int>();
    const std::string dtype = util::dtype_name(main.scalar_type());
    const uint64_t sequence =
        comm_->state.recorder.enqueue(op, dtype, main.numel(), std::move(peers));
    const std::string label = detail::concat(describe(op, main), " #", sequence);
    auto pending = std::make_shared<PendingOp>();
    pending->tensors = std::move(keep);
    if (traced) {
      pending->op = op;
      pending->trace_args = internal::collective_trace_args(comm_->state, sequence, dtype,
                                                            main.numel(), traced_peers);
      pending->trace_start_us = metrics::trace_now_us();
    }
    try {
      LOOM_CHECK_CUDA(cudaSetDevice(options_.device));
      Event ready;
      LOOM_CHECK_CUDA(cudaEventRecord(ready.get(), current_compute_stream(options_.device)));
      LOOM_CHECK_CUDA(cudaStreamWaitEvent(comm_->stream, ready.get(), 0));
      comm_->state.recorder.start(sequence);
      comm_->with_comm([&](ncclComm_t comm) { body(comm, comm_->stream); });
      comm_->settle(Clock::now() + timeout, label);
      LOOM_CHECK_CUDA(cudaEventRecord(pending->done.get(), comm_->stream));
    } catch (const std::exception& e) {
      comm_->fail(detail::concat(label, " could not be enqueued: ", e.what()));
      comm_->state.recorder.finish(sequence, OpState::kFailed);
      throw;
    }
    std::weak_ptr<Comm> weak = comm_;
    auto on_timeout = [weak](const WorkImpl& work) {
      const std::shared_ptr<Comm> comm = weak.lock();
      if (!comm) return std::string();
      const std::string note =
          comm->fail(detail::concat("a wait on ", work.op(), " #", work.sequence(), " timed out"));
      comm->state.recorder.finish(work.sequence(), OpState::kFailed);
      return detail::concat("The communicator was aborted.", note.empty() ? "" : " ", note);
    };
    auto impl = std::make_shared<WorkImpl>(op, sequence, comm_->state.description, timeout,
                                           on_timeout, poll_op(comm_, pending, sequence, label));
    return std::make_shared<NcclWork>(std::move(impl), std::move(pending), options_.device);
  }

  // Constant after construction.
  Store& store_;  // subgroups bootstrap through it
  const std::string store_prefix_;
  const NcclOptions options_;
  const std::shared_ptr<Comm> comm_;
  at::Tensor barrier_buffer_;  // the one-element all-reduce barrier() runs
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Group> new_nccl_group(Store& store, int rank, int size,
                                      const NcclOptions& options) {
  internal::check_new_group("new_nccl_group", rank, size, options.name, options.connect_timeout);
  LOOM_CHECK(options.device >= 0, InvalidArgument,
             "new_nccl_group: options.device must be >= 0, got ", options.device);
  // As Gloo: each rank counts its own creations of a group name, so a reused name (tests,
  // restarts in one process) reads a fresh unique id, never the previous group's.
  return std::make_unique<NcclGroup>(
      store, internal::fresh_store_prefix(store, "nccl/" + options.name, rank), rank, size,
      options);
}

}  // namespace loom::comm
