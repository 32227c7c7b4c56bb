// The NCCL backend (see loom/comm/nccl.h). Compiled only with CUDA.
//
// Ordering: an op records an event on the caller's compute stream, makes the group's stream
// wait for it, enqueues the NCCL call (and any copies) on the group's stream and records a
// `done` event there. Work::wait() polls `done` and the communicator's async error against the
// deadline, then makes the compute stream wait for `done`. Every tensor an op touches is held
// by its Work until then.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "comm/cuda_check.h"
#include "comm/cuda_stream.h"
#include "comm/group_internal.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/nccl.h"

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

// What a group and its Work handles share.
struct Comm {
  // Constant after construction.
  int rank = 0;
  int size = 1;
  int device = 0;
  std::string name;
  std::filesystem::path flight_dump_dir;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // Set once, when an op fails or times out: the communicator is then aborted.
  std::atomic<bool> broken{false};
  std::string broken_reason;  // written before `broken` is set, read after
  FlightRecorder flight;

  explicit Comm(size_t flight_capacity) : flight(flight_capacity) {}
  ~Comm() {
    if (comm != nullptr) {
      if (broken) {
        ncclCommAbort(comm);
      } else {
        ncclCommDestroy(comm);
      }
    }
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // Polls a non-blocking communicator until its last call finished; aborts at the deadline.
  void settle(Clock::time_point deadline, const std::string& what) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      LOOM_CHECK_NCCL(ncclCommGetAsyncError(comm, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        fail(detail::concat(what, " failed: ", ncclGetErrorString(state)));
        throw CommError(broken_reason);
      }
      if (Clock::now() > deadline) {
        fail(detail::concat(what, " did not finish before its deadline"));
        throw Timeout(broken_reason);
      }
      std::this_thread::yield();
    }
  }

  void fail(const std::string& reason) {
    if (!broken.exchange(true)) {
      broken_reason = detail::concat("NCCL group '", name, "' rank ", rank, ": ", reason);
      ncclCommAbort(comm);
      comm = nullptr;
      if (!flight_dump_dir.empty()) {
        flight.dump(flight_dump_dir / detail::concat("rank_", rank, ".json"), rank, name);
      }
    }
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Comm> comm, uint64_t sequence, std::string what,
           std::vector<at::Tensor> tensors, std::chrono::milliseconds timeout)
      : comm_(std::move(comm)),
        sequence_(sequence),
        what_(std::move(what)),
        tensors_(std::move(tensors)),
        timeout_(timeout) {
    LOOM_CHECK_CUDA(cudaEventRecord(done_.get(), comm_->stream));
  }

  void wait() override { wait(timeout_); }

  void wait(std::chrono::milliseconds timeout) override {
    Clock::time_point deadline = Clock::now() + timeout;
    while (!is_completed()) {
      if (comm_->broken) throw CommError(comm_->broken_reason);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_->comm, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        comm_->fail(detail::concat(what_, " failed: ", ncclGetErrorString(state)));
        finish(OpState::kFailed);
        throw CommError(comm_->broken_reason);
      }
      if (Clock::now() > deadline) {
        finish(OpState::kFailed);
        comm_->fail(detail::concat(what_, " did not complete within ", timeout.count(),
                                   " ms; communicator aborted"));
        throw Timeout(comm_->broken_reason);
      }
      std::this_thread::yield();
    }
    if (error_) std::rethrow_exception(error_);
    finish(OpState::kCompleted);
    // Later work on the caller's stream sees the result.
    LOOM_CHECK_CUDA(cudaStreamWaitEvent(current_compute_stream(comm_->device), done_.get(), 0));
  }

  bool is_completed() const override {
    if (completed_) return true;
    cudaError_t state = cudaEventQuery(done_.get());
    if (state == cudaErrorNotReady) return false;
    if (state != cudaSuccess) {
      error_ = std::make_exception_ptr(
          CommError(detail::concat(what_, ": ", cudaGetErrorString(state))));
    }
    completed_ = true;
    return true;
  }

  std::exception_ptr exception() const override {
    is_completed();
    return error_;
  }
  uint64_t sequence() const override { return sequence_; }

 private:
  void finish(OpState state) {
    if (!finished_) comm_->flight.finish(sequence_, state);
    finished_ = true;
  }

  std::shared_ptr<Comm> comm_;
  const uint64_t sequence_;
  const std::string what_;
  std::vector<at::Tensor> tensors_;  // kept alive until the op is done
  const std::chrono::milliseconds timeout_;
  Event done_;
  mutable bool completed_ = false;
  mutable std::exception_ptr error_;
  bool finished_ = false;
};

std::string describe(const char* op, const at::Tensor& t) {
  return detail::concat(op, " ", internal::dtype_name(t.scalar_type()), "[", t.numel(), "]");
}

class NcclGroup final : public Group {
 public:
  NcclGroup(Store& store, int rank, int size, const NcclOptions& options)
      : store_(store), options_(options), comm_(std::make_shared<Comm>(options.flight_capacity)) {
    LOOM_CHECK(size >= 1 && rank >= 0 && rank < size, InvalidArgument, "NCCL group '", options.name,
               "': rank ", rank, " outside [0, ", size, ")");
    comm_->rank = rank;
    comm_->size = size;
    comm_->device = options.device;
    comm_->name = options.name;
    comm_->flight_dump_dir = options.flight_dump_dir;
    LOOM_CHECK_CUDA(cudaSetDevice(options.device));
    LOOM_CHECK_CUDA(cudaStreamCreateWithFlags(&comm_->stream, cudaStreamNonBlocking));

    ncclUniqueId id;
    PrefixStore scoped("nccl/" + options.name, store);
    if (rank == 0) {
      LOOM_CHECK_NCCL(ncclGetUniqueId(&id));
      scoped.set("unique_id", std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    } else {
      std::string bytes = scoped.get("unique_id", options.connect_timeout);
      LOOM_CHECK(bytes.size() == sizeof(id), CorruptData, "NCCL group '", options.name,
                 "': the unique id in the store has ", bytes.size(), " bytes, expected ",
                 sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    LOOM_CHECK_NCCL(ncclCommInitRankConfig(&comm_->comm, size, id, rank, &config));
    comm_->settle(Clock::now() + options.connect_timeout, "communicator initialisation");
    barrier_buffer_ =
        at::zeros({1}, at::TensorOptions()
                           .dtype(at::kFloat)
                           .device(at::kCUDA, static_cast<c10::DeviceIndex>(options.device)));
  }

  int rank() const override { return comm_->rank; }
  int size() const override { return comm_->size; }
  const std::string& name() const override { return comm_->name; }
  const FlightRecorder& flight_recorder() const override { return comm_->flight; }

  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options) override {
    check(tensor, "all_reduce");
    return launch(describe("all_reduce", tensor), tensor, {}, {tensor}, options.timeout,
                  [&](cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(),
                                                  tensor.numel(), nccl_dtype(tensor.scalar_type()),
                                                  nccl_op(options.op), comm_->comm, s));
                  });
  }

  WorkPtr all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                               const AllReduceOptions& options) override {
    LOOM_CHECK(!tensors.empty(), InvalidArgument, "all_reduce_coalesced needs tensors");
    std::vector<at::Tensor> flat_views;
    for (auto& t : tensors) {
      check(t, "all_reduce_coalesced");
      LOOM_CHECK(t.scalar_type() == tensors[0].scalar_type(), InvalidArgument,
                 "all_reduce_coalesced: every tensor must have one dtype; got ",
                 tensors[0].scalar_type(), " and ", t.scalar_type());
      flat_views.push_back(t.reshape({-1}));
    }
    at::Tensor flat = at::cat(flat_views);  // on the compute stream, before `ready`
    std::vector<at::Tensor> keep = tensors;
    keep.push_back(flat);
    return launch(describe("all_reduce_coalesced", flat), flat, {}, keep, options.timeout,
                  [&](cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclAllReduce(flat.data_ptr(), flat.data_ptr(), flat.numel(),
                                                  nccl_dtype(flat.scalar_type()),
                                                  nccl_op(options.op), comm_->comm, s));
                    int64_t offset = 0;
                    for (auto& t : tensors) {
                      copy_async(t, flat, offset, s);
                      offset += t.numel();
                    }
                  });
  }

  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options) override {
    check(output, "reduce_scatter");
    check(input, "reduce_scatter");
    ShardRange mine = shard_range(input.numel(), size(), rank());
    LOOM_CHECK(output.numel() == mine.size(), InvalidArgument, "reduce_scatter: rank ", rank(),
               " owns ", mine.size(), " of ", input.numel(), " elements but output has ",
               output.numel());
    // NCCL splits evenly: pad the input to size() chunks of ceil(n / size()).
    int64_t chunk = (input.numel() + size() - 1) / size();
    at::Tensor padded = input.reshape({-1});
    if (chunk * size() != input.numel()) {
      padded = at::zeros({chunk * size()}, input.options());
      padded.slice(0, 0, input.numel()).copy_(input.reshape({-1}));
    }
    at::Tensor result = output.numel() == chunk ? output : at::empty({chunk}, output.options());
    return launch(describe("reduce_scatter", input), input, {}, {output, padded, result},
                  options.timeout, [&](cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclReduceScatter(padded.data_ptr(), result.data_ptr(), chunk,
                                                      nccl_dtype(input.scalar_type()),
                                                      nccl_op(options.op), comm_->comm, s));
                    if (!result.is_same(output)) copy_async(output, result, 0, s);
                  });
  }

  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input,
                     const AllGatherOptions& options) override {
    check(output, "all_gather");
    check(input, "all_gather");
    LOOM_CHECK(output.numel() == input.numel() * size(), InvalidArgument,
               "all_gather: output needs ", input.numel() * size(), " elements, has ",
               output.numel());
    return launch(
        describe("all_gather", input), input, {}, {output, input}, options.timeout,
        [&](cudaStream_t s) {
          LOOM_CHECK_NCCL(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                                        nccl_dtype(input.scalar_type()), comm_->comm, s));
        });
  }

  WorkPtr all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                     const AllGatherOptions& options) override {
    LOOM_CHECK(static_cast<int>(outputs.size()) == size(), InvalidArgument, "all_gather: needs ",
               size(), " outputs, got ", outputs.size());
    at::Tensor flat = at::empty({input.numel() * size()}, input.options());
    std::vector<at::Tensor> keep = outputs;
    keep.push_back(flat);
    keep.push_back(input);
    for (auto& out : outputs) check(out, "all_gather");
    check(input, "all_gather");
    return launch(describe("all_gather", input), input, {}, keep, options.timeout,
                  [&](cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclAllGather(input.data_ptr(), flat.data_ptr(), input.numel(),
                                                  nccl_dtype(input.scalar_type()), comm_->comm, s));
                    for (int r = 0; r < size(); ++r)
                      copy_async(outputs[r], flat, r * input.numel(), s);
                  });
  }

  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options) override {
    check(tensor, "broadcast");
    return launch(describe("broadcast", tensor), tensor, {options.root}, {tensor}, options.timeout,
                  [&](cudaStream_t s) {
                    LOOM_CHECK_NCCL(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(),
                                                  tensor.numel(), nccl_dtype(tensor.scalar_type()),
                                                  options.root, comm_->comm, s));
                  });
  }

  WorkPtr barrier(const BarrierOptions& options) override {
    return all_reduce(barrier_buffer_, {.op = ReduceOp::kSum, .timeout = options.timeout});
  }

  // NCCL has no tags: sends and receives between two ranks match in issue order.
  WorkPtr send(const at::Tensor& tensor, int dst, const SendRecvOptions& options) override {
    check(tensor, "send");
    return launch(
        describe("send", tensor), tensor, {dst}, {tensor}, options.timeout, [&](cudaStream_t s) {
          LOOM_CHECK_NCCL(ncclSend(tensor.data_ptr(), tensor.numel(),
                                   nccl_dtype(tensor.scalar_type()), dst, comm_->comm, s));
        });
  }

  WorkPtr recv(at::Tensor& tensor, int src, const SendRecvOptions& options) override {
    check(tensor, "recv");
    return launch(
        describe("recv", tensor), tensor, {src}, {tensor}, options.timeout, [&](cudaStream_t s) {
          LOOM_CHECK_NCCL(ncclRecv(tensor.data_ptr(), tensor.numel(),
                                   nccl_dtype(tensor.scalar_type()), src, comm_->comm, s));
        });
  }

  // The lowest listed rank makes a unique id for the subset and shares it through the store.
  std::unique_ptr<Group> new_subgroup(const std::vector<int>& ranks) override {
    std::vector<int> sorted = ranks;
    std::sort(sorted.begin(), sorted.end());
    auto me = std::find(sorted.begin(), sorted.end(), rank());
    LOOM_CHECK(me != sorted.end(), InvalidArgument, "new_subgroup: rank ", rank(),
               " is not among the listed ranks");
    NcclOptions sub = options_;
    sub.name = detail::concat(options_.name, "/sub", ++subgroups_, "[");
    for (size_t i = 0; i < sorted.size(); ++i) sub.name += detail::concat(i ? "," : "", sorted[i]);
    sub.name += "]";
    return std::make_unique<NcclGroup>(store_, static_cast<int>(me - sorted.begin()),
                                       static_cast<int>(sorted.size()), sub);
  }

 private:
  void check(const at::Tensor& t, const char* op) const {
    LOOM_CHECK(t.is_cuda() && t.get_device() == comm_->device, InvalidArgument, "NCCL ", op,
               " in group '", comm_->name, "' needs tensors on cuda:", comm_->device, ", got ",
               t.device());
    LOOM_CHECK(t.is_contiguous(), InvalidArgument, "NCCL ", op, ": tensor of shape ", t.sizes(),
               " is not contiguous; call .contiguous() first");
    nccl_dtype(t.scalar_type());
  }

  // dst <- src[offset, offset + dst.numel()) on stream s.
  static void copy_async(at::Tensor& dst, const at::Tensor& src, int64_t offset, cudaStream_t s) {
    size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
    if (bytes == 0) return;
    const char* from = static_cast<const char*>(src.data_ptr()) + offset * src.element_size();
    LOOM_CHECK_CUDA(cudaMemcpyAsync(dst.data_ptr(), from, bytes, cudaMemcpyDeviceToDevice, s));
  }

  template <typename Body>
  WorkPtr launch(const std::string& what, const at::Tensor& main, std::vector<int> peers,
                 std::vector<at::Tensor> keep, std::chrono::milliseconds timeout, Body body) {
    if (comm_->broken) throw CommError(comm_->broken_reason);
    uint64_t sequence = comm_->flight.enqueue(what.substr(0, what.find(' ')),
                                              internal::dtype_name(main.scalar_type()),
                                              main.numel(), std::move(peers));
    LOOM_CHECK_CUDA(cudaSetDevice(comm_->device));
    Event ready;
    LOOM_CHECK_CUDA(cudaEventRecord(ready.get(), current_compute_stream(comm_->device)));
    LOOM_CHECK_CUDA(cudaStreamWaitEvent(comm_->stream, ready.get(), 0));
    comm_->flight.start(sequence);
    std::string label = detail::concat(what, " #", sequence);
    body(comm_->stream);
    comm_->settle(Clock::now() + timeout, label);
    return std::make_shared<NcclWork>(comm_, sequence, label, std::move(keep), timeout);
  }

  Store& store_;
  const NcclOptions options_;
  std::shared_ptr<Comm> comm_;
  at::Tensor barrier_buffer_;
  int subgroups_ = 0;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Group> new_nccl_group(Store& store, int rank, int size,
                                      const NcclOptions& options) {
  return std::make_unique<NcclGroup>(store, rank, size, options);
}

}  // namespace loom::comm
