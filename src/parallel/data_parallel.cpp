// DataParallel: flat per-bucket parameter and gradient buffers, gradient-accumulator post-hooks
// that launch each bucket's reduction as soon as its gradients are accumulated, and the
// (optionally ZeRO-sharded) optimizer step over those buffers.
#include "loom/parallel/data_parallel.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "comm/group_internal.h"
#include "loom/ckpt/export.h"
#include "loom/ckpt/state.h"
#include "loom/error.h"
#include "loom/metrics/allocations.h"
#include "optim/sum_of_squares.h"
#include "parallel/grad_view.h"
#include "parallel/optim_blob.h"
#include "parallel/placement.h"
#include "util/deadline.h"
#include "util/dtype.h"

namespace loom::parallel {

const char* to_string(ZeroStage stage) {
  switch (stage) {
    case ZeroStage::kNone:
      return "none";
    case ZeroStage::kOne:
      return "zero1";
    case ZeroStage::kTwo:
      return "zero2";
  }
  return "?";
}

ConfigSchema DataParallelOptions::schema() {
  ConfigSchema s;
  s.add("parallel.bucket_mb", 25.0, "gradient bucket size in MiB (zero2: a few % of the model)");
  s.add("parallel.find_unused_parameters", false,
        "reduce parameters that got no gradient as zeros instead of failing naming them");
  return s;
}

DataParallelOptions DataParallelOptions::from(const Config& config) {
  DataParallelOptions o;
  switch (mode_from(config)) {
    case Mode::kDdp:
      o.zero_stage = ZeroStage::kNone;
      break;
    case Mode::kZero1:
      o.zero_stage = ZeroStage::kOne;
      break;
    case Mode::kZero2:
      o.zero_stage = ZeroStage::kTwo;
      break;
    case Mode::kFsdp:
      throw ConfigError(
          "parallel.mode is 'fsdp', which is FullyShardedDataParallel, not DataParallel: build "
          "the strategy with parallel::make_strategy (docs/parallel.md)");
  }
  const double mb = config.get<double>("parallel.bucket_mb");
  LOOM_CHECK(mb > 0 && mb <= 4096, ConfigError, "parallel.bucket_mb is ", mb,
             "; use a size in MiB in (0, 4096]");
  o.bucket_bytes = static_cast<size_t>(mb * (1 << 20));
  o.find_unused_parameters = config.get<bool>("parallel.find_unused_parameters");
  return o;
}

namespace {

using Clock = std::chrono::steady_clock;
using metrics::MemoryCategory;
using metrics::MemoryCategoryScope;
using std::chrono::milliseconds;

struct Param {
  std::string name;
  at::Tensor tensor;  // the module's parameter; its data is a view into its bucket's buffer
  int bucket = 0;
  int64_t offset = 0;  // first element in the bucket's flat buffer
  int64_t numel = 0;
  std::vector<int64_t> shape;
  std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive so the hook stays on it
  uintptr_t hook_key = 0;
  bool ready = false;  // its gradient arrived in the current synced backward
  // Under model parallelism (placement.h): its piece of the whole model's tensor, and whether
  // this rank counts and writes it. Unset (replicated, primary) otherwise.
  std::optional<internal::Placement> placement;
};

struct Bucket {
  std::vector<int> params;  // indices into Impl::params, in bucket order
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;   // real elements
  int64_t padded = 0;  // numel rounded up to a multiple of the world size
  int64_t shard_begin = 0;
  int64_t shard_end = 0;  // this rank's slice of the padded buffer ([0, padded) for kNone)
  at::Tensor data;        // flat parameters
  // Flat gradients. kNone/kOne: allocated once, and the parameters' .grad() are views into it.
  // kTwo: a staging buffer that exists only from the bucket's first gradient of a synced
  // backward until its reduce-scatter completes; the parameters' .grad() are then released.
  at::Tensor grad;
  at::Tensor grad_shard;  // kTwo: the reduced gradient of this rank's slice
  at::Tensor master;      // fp32 copy of the slice when the bucket is not fp32 (master weights)
  std::vector<at::Tensor> state;  // the optimizer's state for the slice, fp32
  int pending = 0;                // parameters whose gradient has not arrived yet
  comm::WorkPtr work;
  int64_t shard_size() const { return shard_end - shard_begin; }
};

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

// "name|dtype|shape" per parameter, one per line: what every rank must agree on.
std::string signature_line(const std::string& name, const at::Tensor& t) {
  return name + "|" + util::dtype_name(t.scalar_type()) + "|" + shape_string(t.sizes());
}

// Runs after a parameter's AccumulateGrad node has added the new gradient into .grad().
class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

}  // namespace

struct DataParallel::Impl {
  // Constant after construction.
  std::shared_ptr<torch::nn::Module> module;
  comm::Group& group;    // the parameters' and gradients' tensors (NCCL on CUDA)
  comm::Group* control;  // host bytes of the construction checks; null = `group`
  DataParallelOptions options;
  int rank = 0;
  int world = 1;
  at::Device device{at::kCPU};  // every parameter's, so every buffer's
  std::vector<Param> params;
  std::vector<Bucket> buckets;

  // Training-thread state (one thread at a time; hooks run on the thread that runs backward).
  bool sync = true;
  int arrived = 0;               // parameters ready in the current synced backward
  int next_bucket = 0;           // buckets are launched in index order on every rank
  int launched_in_backward = 0;  // buckets launched by hooks in the current sync window
  SyncStats stats;
  int64_t gradient_bytes = 0;       // live bytes of the buffers below, now
  int64_t peak_gradient_bytes = 0;  // and at their most in the current sync window
  std::unique_ptr<optim::FlatOptimizer> optimizer;
  int64_t steps = 0;

  Impl(std::shared_ptr<torch::nn::Module> m, comm::Group& g, comm::Group* c,
       const DataParallelOptions& o)
      : module(std::move(m)), group(g), control(c), options(o), rank(g.rank()), world(g.size()) {}

  at::TensorOptions on_device(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(device);
  }

  std::string describe_bucket(int b) const {
    const Bucket& bucket = buckets[b];
    std::string names;
    for (size_t i = 0; i < bucket.params.size() && i < 4; ++i) {
      names += (i ? ", " : "") + params[bucket.params[i]].name;
    }
    if (bucket.params.size() > 4) names += ", ...";
    return detail::concat("bucket ", b, " of ", buckets.size(), " (", bucket.params.size(),
                          " parameters: ", names, "; ", bucket.numel, " elements)");
  }

  // --- construction -------------------------------------------------------------------------

  // Every parameter (and buffer, which is broadcast with them) on one device: the first
  // parameter's. Buffers are the parameters' device, so the groups' device rules hold for all.
  void check_device(const std::string& kind, const std::string& name, const at::Tensor& t,
                    const std::string& first) const {
    LOOM_CHECK(t.device() == device, InvalidArgument, "DataParallel: ", kind, " '", name,
               "' is on ", t.device().str(), " but parameter '", first, "' is on ", device.str(),
               "; move the whole module to one device (module->to(device)) before building "
               "DataParallel");
  }

  void collect_parameters() {
    std::unordered_set<const void*> seen;  // a parameter shared by two modules counts once
    std::string first;
    std::map<std::string, internal::Placement> placed;
    if (options.model_parallel.active())
      placed = internal::placements(*module, options.model_parallel);
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      const at::Tensor& t = item.value();
      if (!t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
      LOOM_CHECK(t.layout() == at::kStrided, InvalidArgument, "DataParallel: parameter '",
                 item.key(), "' must be a dense (strided) tensor");
      if (first.empty()) {
        first = item.key();
        device = t.device();
      }
      check_device("parameter", item.key(), t, first);
      Param p;
      p.name = item.key();
      p.tensor = t;
      p.numel = t.numel();
      p.shape = t.sizes().vec();
      if (const auto it = placed.find(p.name); it != placed.end()) p.placement = it->second;
      params.push_back(std::move(p));
    }
    for (const auto& item : module->named_buffers(/*recurse=*/true)) {
      if (!first.empty()) check_device("buffer", item.key(), item.value(), first);
    }
  }

  // Every rank compares every rank's signature with rank 0's, so all ranks throw alike. The
  // bytes go over the control group as CPU tensors, or, without one, over the tensor group on
  // the parameters' device (construction only; the host reads them back).
  void check_same_parameters(milliseconds timeout) {
    comm::Group& checks = control != nullptr ? *control : group;
    const at::Device where = control != nullptr ? at::Device(at::kCPU) : device;
    std::string mine;
    for (const Param& p : params) mine += signature_line(p.name, p.tensor) + "\n";
    const auto lines = comm::internal::all_gather_lines(checks, mine, where, timeout);
    auto text_of = [&](int r) { return lines[static_cast<size_t>(r)]; };
    const std::vector<std::string> reference = text_of(0);
    for (int r = 1; r < world; ++r) {
      const std::vector<std::string> other = text_of(r);
      for (size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
        const std::string a = i < reference.size() ? reference[i] : "(none)";
        const std::string b = i < other.size() ? other[i] : "(none)";
        if (a != b) {
          throw InvalidArgument(detail::concat(
              "DataParallel: rank ", r, "'s parameters differ from rank 0's at parameter ", i,
              " (name|dtype|shape): rank 0 has '", a, "', rank ", r, " has '", b,
              "'. Every rank must build the same model."));
        }
      }
    }
  }

  void build_buckets() {
    // Reverse registration order: roughly the order backward produces gradients.
    int64_t bytes = 0;
    for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
      const at::ScalarType dtype = params[i].tensor.scalar_type();
      if (buckets.empty() || bytes >= static_cast<int64_t>(options.bucket_bytes) ||
          buckets.back().dtype != dtype) {
        buckets.emplace_back();
        buckets.back().dtype = dtype;
        bytes = 0;
      }
      Bucket& bucket = buckets.back();
      params[i].bucket = static_cast<int>(buckets.size()) - 1;
      params[i].offset = bucket.numel;
      bucket.numel += params[i].numel;
      bucket.params.push_back(i);
      bytes += params[i].numel * static_cast<int64_t>(c10::elementSize(dtype));
    }
    const bool sharded = options.zero_stage != ZeroStage::kNone;
    for (Bucket& bucket : buckets) {
      bucket.padded = (bucket.numel + world - 1) / world * world;
      const int64_t chunk = bucket.padded / world;
      bucket.shard_begin = sharded ? rank * chunk : 0;
      bucket.shard_end = sharded ? (rank + 1) * chunk : bucket.padded;
      bucket.pending = static_cast<int>(bucket.params.size());
    }
  }

  at::Tensor grad_view(const Param& p) const {
    return buckets[p.bucket].grad.narrow(0, p.offset, p.numel).view(p.shape);
  }

  bool sharded_gradients() const { return options.zero_stage == ZeroStage::kTwo; }

  // Gradient memory accounting: every gradient buffer DataParallel allocates or releases.
  void count_gradient_bytes(const at::Tensor& t, int sign) {
    gradient_bytes += sign * t.numel() * static_cast<int64_t>(t.element_size());
    peak_gradient_bytes = std::max(peak_gradient_bytes, gradient_bytes);
  }

  void move_into_buckets() {
    torch::NoGradGuard no_grad;
    for (Bucket& bucket : buckets) {
      {
        MemoryCategoryScope parameters(MemoryCategory::kParameters);
        bucket.data = at::zeros({bucket.padded}, on_device(bucket.dtype));
      }
      MemoryCategoryScope gradients(MemoryCategory::kGradients);
      if (sharded_gradients()) {
        bucket.grad_shard = at::zeros({bucket.shard_size()}, on_device(bucket.dtype));
        count_gradient_bytes(bucket.grad_shard, +1);
      } else {
        bucket.grad = at::zeros({bucket.padded}, on_device(bucket.dtype));
        count_gradient_bytes(bucket.grad, +1);
      }
    }
    for (Param& p : params) {
      Bucket& bucket = buckets[p.bucket];
      at::Tensor view = bucket.data.narrow(0, p.offset, p.numel).view(p.shape);
      view.copy_(p.tensor);
      p.tensor.set_data(view);
      p.tensor.mutable_grad() = sharded_gradients() ? at::Tensor() : grad_view(p);
    }
  }

  void broadcast_from_rank0(milliseconds timeout) {
    const Clock::time_point deadline = Clock::now() + timeout;
    for (Bucket& bucket : buckets) {
      group.broadcast(bucket.data, {.root = 0, .timeout = timeout})
          ->wait(util::time_left(deadline));
    }
    torch::NoGradGuard no_grad;
    for (at::Tensor buffer : module->buffers(/*recurse=*/true)) {
      // Collectives carry no bool: a bool buffer (e.g. a causal mask) travels as its bytes.
      at::Tensor contiguous =
          buffer.scalar_type() == at::kBool ? buffer.to(at::kByte) : buffer.contiguous();
      group.broadcast(contiguous, {.root = 0, .timeout = timeout})->wait(util::time_left(deadline));
      if (!contiguous.is_same(buffer)) buffer.copy_(contiguous);
    }
  }

  void init_masters() {
    MemoryCategoryScope state(MemoryCategory::kOptimizerState);
    for (Bucket& bucket : buckets) {
      if (bucket.dtype != at::kFloat && options.master_weights) {
        bucket.master =
            bucket.data.narrow(0, bucket.shard_begin, bucket.shard_size()).to(at::kFloat);
      }
    }
  }

  void install_hooks();  // below: needs the hook class

  // --- gradient sync ------------------------------------------------------------------------

  void on_gradient_accumulated(int index) {
    if (sharded_gradients()) {
      on_gradient_accumulated_sharded(index);
      return;
    }
    Param& p = params[index];
    adopt_gradient(p);
    if (!sync) return;
    LOOM_CHECK(!p.ready, InvalidArgument, "DataParallel: parameter '", p.name,
               "' got a second gradient before finish_gradient_sync; run micro-steps of gradient "
               "accumulation under no_sync()");
    p.ready = true;
    ++arrived;
    --buckets[p.bucket].pending;
    if (options.overlap) launch_ready_buckets(/*during_backward=*/true);
  }

  // kNone/kOne: makes p's .grad() its view of the bucket again. Someone may have replaced it
  // (e.g. set it to none): accumulation then started afresh in a new tensor; it moves back in.
  void adopt_gradient(Param& p) {
    internal::adopt_gradient(p.tensor, p.tensor.grad(), grad_view(p));
  }

  void reduce_accumulated_gradients() {
    torch::NoGradGuard no_grad;
    std::vector<std::pair<at::Tensor, comm::Group*>> tied;
    for (Param& p : params) {
      if (!sharded_gradients()) adopt_gradient(p);
      if (p.placement && p.placement->tied != nullptr) {
        if (!p.tensor.grad().defined()) p.tensor.mutable_grad() = at::zeros_like(p.tensor);
        tied.emplace_back(p.tensor.grad(), p.placement->tied);
      }
    }
    internal::sum_tied_gradients(tied, options.timeout);
    sync = true;
    for (Param& p : params) {
      LOOM_CHECK(!p.ready, InvalidArgument,
                 "DataParallel::reduce_accumulated_gradients: parameter '", p.name,
                 "' already got its gradient in a synced backward; run the backwards "
                 "under no_sync()");
      if (sharded_gradients()) stage_gradient(p);
      p.ready = true;
      ++arrived;
      --buckets[p.bucket].pending;
    }
    launch_ready_buckets(/*during_backward=*/false);
  }

  // kTwo: outside a synced backward the gradient stays in .grad() (allocated by autograd, as
  // without DataParallel), so micro-steps accumulate there. In a synced backward it moves into
  // the bucket's staging buffer and .grad() is released at once; the staging buffer lives until
  // the bucket's reduce-scatter completes.
  void on_gradient_accumulated_sharded(int index) {
    Param& p = params[index];
    if (!sync) return;
    LOOM_CHECK(!p.ready, InvalidArgument, "DataParallel: parameter '", p.name,
               "' got a second gradient before finish_gradient_sync; run micro-steps of gradient "
               "accumulation under no_sync()");
    stage_gradient(p);
    p.ready = true;
    ++arrived;
    --buckets[p.bucket].pending;
    release_reduced_staging();
    if (options.overlap) launch_ready_buckets(/*during_backward=*/true);
  }

  // Moves p's accumulated .grad() (none: zero) into its bucket's staging buffer.
  void stage_gradient(Param& p) {
    torch::NoGradGuard no_grad;
    Bucket& bucket = buckets[p.bucket];
    if (!bucket.grad.defined()) {  // zeros: padding, and parameters that got no gradient
      limit_staging(p.bucket);
      MemoryCategoryScope gradients(MemoryCategory::kGradients);
      bucket.grad = at::zeros({bucket.padded}, on_device(bucket.dtype));
      count_gradient_bytes(bucket.grad, +1);
    }
    at::Tensor& grad = p.tensor.mutable_grad();
    if (grad.defined()) grad_view(p).copy_(grad);
    grad = at::Tensor();
  }

  // kTwo: drops the staging buffers of launched buckets whose reduce-scatter has completed
  // (an op keeps its own reference to its input until it is done).
  void release_reduced_staging() {
    for (int b = 0; b < next_bucket; ++b) {
      Bucket& bucket = buckets[b];
      if (bucket.grad.defined() && bucket.work && bucket.work->is_completed()) {
        count_gradient_bytes(bucket.grad, -1);
        bucket.grad = at::Tensor();
      }
    }
  }

  // Before bucket `next`'s staging buffer: while max_staging_buckets are alive, waits for the
  // oldest launched one's reduce-scatter and frees it. A bucket is closed once it holds
  // bucket_bytes, so it is under twice that unless it holds a parameter larger than a bucket
  // (an embedding); such a bucket is staged alone, after every launched one has completed. The
  // staging then never holds more than max(max_staging_buckets x 2 x bucket_bytes, the largest
  // bucket). Buckets that are still filling are never waited for (they cannot launch before
  // this gradient is staged), so the limit may be passed by them.
  void limit_staging(int next) {
    if (options.max_staging_buckets <= 0) return;
    release_reduced_staging();
    const Bucket& staged = buckets[next];
    const bool alone = staged.padded * static_cast<int64_t>(c10::elementSize(staged.dtype)) >
                       2 * static_cast<int64_t>(options.bucket_bytes);
    for (;;) {
      int alive = 0;
      int oldest_launched = -1;
      for (int b = 0; b < static_cast<int>(buckets.size()); ++b) {
        if (!buckets[b].grad.defined()) continue;
        ++alive;
        if (b < next_bucket && oldest_launched < 0) oldest_launched = b;
      }
      const bool fits = alone ? alive == 0 : alive < options.max_staging_buckets;
      if (fits || oldest_launched < 0) return;
      wait_for_bucket(oldest_launched, Clock::now() + options.timeout);
      release_reduced_staging();
    }
  }

  // Waits for bucket b's reduction; Timeout and CommError name the bucket.
  void wait_for_bucket(int b, Clock::time_point deadline) {
    try {
      buckets[b].work->wait(util::time_left(deadline));
    } catch (const Timeout& e) {
      throw Timeout(detail::concat(
          "DataParallel on rank ", rank, ": the reduction of ", describe_bucket(b),
          " did not finish within ", options.timeout.count(),
          " ms; did a peer skip backward or finish_gradient_sync? (", e.what(), ")"));
    } catch (const CommError& e) {
      throw CommError(detail::concat("DataParallel on rank ", rank, ": the reduction of ",
                                     describe_bucket(b), " failed: ", e.what()));
    }
  }

  void launch_ready_buckets(bool during_backward) {
    while (next_bucket < static_cast<int>(buckets.size()) && buckets[next_bucket].pending == 0) {
      launch(next_bucket++);
      if (during_backward) ++launched_in_backward;
    }
  }

  void launch(int b) {
    Bucket& bucket = buckets[b];
    const comm::ReduceOp op =
        options.reduction == GradReduction::kMean ? comm::ReduceOp::kAvg : comm::ReduceOp::kSum;
    if (options.zero_stage == ZeroStage::kTwo) {
      bucket.work = group.reduce_scatter(bucket.grad_shard, bucket.grad, {op, options.timeout});
    } else {
      bucket.work = group.all_reduce(bucket.grad, {op, options.timeout});
    }
  }

  void reset_sync_window() {
    for (Param& p : params) p.ready = false;
    for (Bucket& bucket : buckets) {
      bucket.pending = static_cast<int>(bucket.params.size());
      bucket.work.reset();
      if (sharded_gradients() && bucket.grad.defined()) {  // a failed sync: drop its staging
        count_gradient_bytes(bucket.grad, -1);
        bucket.grad = at::Tensor();
      }
    }
    peak_gradient_bytes = gradient_bytes;
    arrived = 0;
    next_bucket = 0;
    launched_in_backward = 0;
  }

  void finish_gradient_sync() {
    if (!sync) return;
    const Clock::time_point start = Clock::now();
    struct Reset {
      Impl* impl;
      ~Reset() { impl->reset_sync_window(); }
    } reset{this};
    LOOM_CHECK(arrived > 0 || params.empty(), InvalidArgument,
               "DataParallel::finish_gradient_sync on rank ", rank,
               ": no gradient arrived since the last sync; run backward (with sync on) first");
    if (arrived < static_cast<int>(params.size())) {
      std::string unused;
      int count = 0;
      for (const Param& p : params) {
        if (p.ready) continue;
        if (count++ < 8) unused += (unused.empty() ? "" : ", ") + p.name;
      }
      LOOM_CHECK(options.find_unused_parameters, InvalidArgument, "DataParallel on rank ", rank,
                 ": ", count, " parameter(s) got no gradient in this backward: ", unused,
                 (count > 8 ? ", ..." : ""),
                 ". Make the loss depend on them, freeze them (requires_grad = false) before "
                 "building DataParallel, or set find_unused_parameters");
      for (Param& p : params) {
        if (!p.ready) {
          if (sharded_gradients()) stage_gradient(p);
          p.ready = true;
          --buckets[p.bucket].pending;
        }
      }
    }
    launch_ready_buckets(/*during_backward=*/false);  // the rest (all of them without overlap)
    const Clock::time_point deadline = start + options.timeout;
    for (int b = 0; b < static_cast<int>(buckets.size()); ++b) wait_for_bucket(b, deadline);
    if (sharded_gradients()) release_reduced_staging();
    stats.buckets = static_cast<int>(buckets.size());
    stats.buckets_launched_during_backward = launched_in_backward;
    stats.wait_seconds = util::seconds_since(start);
    stats.peak_gradient_bytes = peak_gradient_bytes;
  }

  // The reduced gradient of this rank's slice of bucket b.
  at::Tensor reduced_grad_shard(Bucket& bucket) const {
    if (options.zero_stage == ZeroStage::kTwo) return bucket.grad_shard;
    return bucket.grad.narrow(0, bucket.shard_begin, bucket.shard_size());
  }

  double clip_grad_norm(double max_norm) {
    torch::NoGradGuard no_grad;
    // Each rank sums the squares of a disjoint slice (the ZeRO slice even when gradients are
    // replicated), then one all-reduce gives the global sum. It all stays on the parameters'
    // device: on the CPU a float norm per slice, squared and summed in double in bucket order
    // (bitwise what it always was); on CUDA the fused multi-tensor kernel, one pass.
    std::vector<at::Tensor> slices;
    slices.reserve(buckets.size());
    for (Bucket& bucket : buckets) {
      const int64_t chunk = bucket.padded / world;
      at::Tensor slice = options.zero_stage == ZeroStage::kTwo
                             ? bucket.grad_shard
                             : bucket.grad.narrow(0, rank * chunk, chunk);
      if (!options.model_parallel.active()) {
        slices.push_back(slice);
        continue;
      }
      // Only the parameters this rank counts (placement.h), each one's part of the slice.
      for (int i : bucket.params) {
        const Param& p = params[i];
        const int64_t lo = std::max(rank * chunk, p.offset);
        const int64_t hi = std::min((rank + 1) * chunk, p.offset + p.numel);
        if (lo < hi && p.placement->primary)
          slices.push_back(slice.narrow(0, lo - rank * chunk, hi - lo));
      }
    }
    at::Tensor total = slices.empty() ? at::zeros({1}, on_device(at::kDouble))
                                      : optim::internal::sum_of_squares(slices);
    group.all_reduce(total, {comm::ReduceOp::kSum, options.timeout})->wait(options.timeout);
    if (options.model_parallel.active())
      internal::sum_over_model(total, options.model_parallel, options.timeout);
    // The one host read of clipping, and unavoidable: the caller gets the norm (to log it and
    // to decide about a non-finite one) and the coefficient is computed from it as torch does.
    // On CUDA it waits for the all-reduce, which finish_gradient_sync has already waited for.
    const double norm = std::sqrt(total.item<double>());
    // As torch::nn::utils::clip_grad_norm_: the coefficient in the gradients' dtype.
    const double coefficient = std::min(
        1.0,
        static_cast<double>(static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f)));
    if (coefficient < 1.0) {
      for (Bucket& bucket : buckets) {
        (options.zero_stage == ZeroStage::kTwo ? bucket.grad_shard : bucket.grad).mul_(coefficient);
      }
    }
    return norm;
  }

  // --- optimizer ----------------------------------------------------------------------------

  // The optimizer's element-wise update over cache-sized pieces of a flat shard: each op of
  // the update then reads data still in cache (about 2x faster than whole-bucket ops on a
  // large bucket). The arithmetic per element is unchanged, so results are bitwise the same.
  void update_in_chunks(const at::Tensor& params, const at::Tensor& grads,
                        std::vector<at::Tensor>& state) {
    if (!params.is_cpu()) {  // a GPU's fused kernel takes the whole shard in one launch
      optimizer->update(params, grads, state, steps);
      return;
    }
    constexpr int64_t kChunk = 64 * 1024;
    const int64_t n = params.numel();
    std::vector<at::Tensor> piece(state.size());
    for (int64_t at = 0; at < n; at += kChunk) {
      const int64_t len = std::min(kChunk, n - at);
      for (size_t i = 0; i < state.size(); ++i) piece[i] = state[i].narrow(0, at, len);
      optimizer->update(params.narrow(0, at, len), grads.narrow(0, at, len), piece, steps);
    }
  }

  void step() {
    LOOM_CHECK(optimizer != nullptr, InvalidArgument,
               "DataParallel::step: no optimizer; call set_optimizer first");
    torch::NoGradGuard no_grad;
    ++steps;
    for (Bucket& bucket : buckets) {
      at::Tensor grad = reduced_grad_shard(bucket);
      if (grad.scalar_type() != at::kFloat) grad = grad.to(at::kFloat);
      at::Tensor slice = bucket.data.narrow(0, bucket.shard_begin, bucket.shard_size());
      const auto* adamw = dynamic_cast<const optim::AdamW*>(optimizer.get());
      if (bucket.master.defined() && slice.is_cuda() && adamw != nullptr &&
          slice.scalar_type() == at::kBFloat16) {
        // The fused kernel writes the bf16 parameters in the same pass as the fp32 masters.
        adamw->update_with_bf16_copy(bucket.master, grad, bucket.state, steps, slice);
      } else if (bucket.master.defined()) {
        update_in_chunks(bucket.master, grad, bucket.state);
        slice.copy_(bucket.master);
      } else if (bucket.dtype == at::kFloat) {
        update_in_chunks(slice, grad, bucket.state);
      } else {  // no master weights: update in fp32 and round back
        at::Tensor fp32 = slice.to(at::kFloat);
        update_in_chunks(fp32, grad, bucket.state);
        slice.copy_(fp32);
      }
    }
    if (options.zero_stage != ZeroStage::kNone) gather_parameters();
  }

  void gather_parameters() {
    const Clock::time_point deadline = Clock::now() + options.timeout;
    std::vector<at::Tensor> inputs;
    std::vector<comm::WorkPtr> works;
    for (Bucket& bucket : buckets) {
      inputs.push_back(bucket.data.narrow(0, bucket.shard_begin, bucket.shard_size()).clone());
      works.push_back(group.all_gather(bucket.data, inputs.back(), {options.timeout}));
    }
    for (size_t b = 0; b < works.size(); ++b) {
      try {
        works[b]->wait(util::time_left(deadline));
      } catch (const Timeout& e) {
        throw Timeout(
            detail::concat("DataParallel::step on rank ", rank, ": gathering the parameters of ",
                           describe_bucket(static_cast<int>(b)), " timed out (", e.what(), ")"));
      }
    }
  }

  void allocate_state() {
    MemoryCategoryScope state(MemoryCategory::kOptimizerState);
    for (Bucket& bucket : buckets) {
      bucket.state.clear();
      for (size_t i = 0; i < optimizer->state_names().size(); ++i) {
        bucket.state.push_back(at::zeros({bucket.shard_size()}, on_device(at::kFloat)));
      }
    }
  }

  // --- checkpoint state ---------------------------------------------------------------------

  // Calls fn(name, tensor, sharding) for every tensor add_state describes.
  // What a tensor replicated over the data-parallel ranks is: the whole parameter, or its piece of
  // the whole model's (written by data-parallel rank 0 of the rank that writes the piece).
  ckpt::Sharding whole(const Param& p) const {
    if (!p.placement) return ckpt::Sharding::replicated();
    ckpt::Sharding piece = p.placement->piece;
    piece.written = p.placement->primary && rank == 0;
    return piece;
  }
  // Elements [lo, hi) of p (a ZeRO slice).
  ckpt::Sharding part(const Param& p, int64_t lo, int64_t hi) const {
    return p.placement ? p.placement->piece.part(lo, hi) : ckpt::Sharding::flat(p.shape, lo, hi);
  }

  template <typename Fn>
  void for_each_state_tensor(Fn&& fn) {
    const bool replicated = options.zero_stage == ZeroStage::kNone;
    for (Param& p : params) fn("model/" + p.name, p.tensor.detach(), whole(p));
    const std::vector<std::string> names =
        optimizer ? optimizer->state_names() : std::vector<std::string>{};
    for (Param& p : params) {
      Bucket& bucket = buckets[p.bucket];
      const int64_t lo = std::max(bucket.shard_begin, p.offset);
      const int64_t hi = std::min(bucket.shard_end, p.offset + p.numel);
      auto describe = [&](const std::string& name, const at::Tensor& shard_tensor) {
        if (lo >= hi) {  // this rank owns none of p: an empty piece, so that every rank
                         // describes (and a strict load asks for) every tensor
          const int64_t at = std::clamp<int64_t>(bucket.shard_begin - p.offset, 0, p.numel);
          fn(name, at::empty({0}, shard_tensor.options()), part(p, at, at));
          return;
        }
        const at::Tensor piece = shard_tensor.narrow(0, lo - bucket.shard_begin, hi - lo);
        if (replicated) {
          fn(name, piece.view(p.shape), whole(p));
        } else {
          fn(name, piece, part(p, lo - p.offset, hi - p.offset));
        }
      };
      for (size_t i = 0; i < names.size() && i < bucket.state.size(); ++i) {
        describe("optim/" + p.name + "/" + names[i], bucket.state[i]);
      }
      if (bucket.master.defined()) describe("optim/" + p.name + "/master", bucket.master);
    }
  }

  std::string optim_blob() const {
    nlohmann::json blob;
    blob["optimizer"] = optimizer ? optimizer->name() : "";
    blob["step"] = steps;
    blob["zero_stage"] = static_cast<int>(options.zero_stage);
    return blob.dump();
  }

  void add_state(ckpt::State& state) {
    for_each_state_tensor([&](const std::string& name, const at::Tensor& t,
                              const ckpt::Sharding& sharding) { state.add(name, t, sharding); });
    state.blobs["optim"] = optim_blob();
  }

  void load_state(const ckpt::State& source) {
    std::map<std::string, const ckpt::TensorEntry*> by_name;
    for (const ckpt::TensorEntry& entry : source.tensors) by_name[entry.name] = &entry;
    const int64_t saved_steps =
        internal::read_optim_blob(source, optimizer.get(), "DataParallel::load_state");
    torch::NoGradGuard no_grad;
    for_each_state_tensor(
        [&](const std::string& name, const at::Tensor& t, const ckpt::Sharding& sharding) {
          const auto it = by_name.find(name);
          LOOM_CHECK(it != by_name.end(), InvalidArgument, "DataParallel::load_state: no tensor '",
                     name, "' in the state");
          const ckpt::TensorEntry& entry = *it->second;
          LOOM_CHECK(entry.tensor.numel() == t.numel() && entry.sharding.begin == sharding.begin &&
                         entry.sharding.end == sharding.end,
                     InvalidArgument, "DataParallel::load_state: '", name, "' holds ",
                     entry.tensor.numel(), " elements [", entry.sharding.begin, ", ",
                     entry.sharding.end, "), this rank needs ", t.numel(), " [", sharding.begin,
                     ", ", sharding.end, ")");
          if (!entry.tensor.is_same(t) && entry.tensor.data_ptr() != t.data_ptr()) {
            t.copy_(entry.tensor.reshape(t.sizes()));
          }
        });
    steps = saved_steps;
    for (Bucket& bucket : buckets) {  // parameters are the rounded masters
      if (bucket.master.defined()) {
        bucket.data.narrow(0, bucket.shard_begin, bucket.shard_size()).copy_(bucket.master);
      }
    }
    if (options.zero_stage != ZeroStage::kNone) gather_parameters();
  }

  int64_t optimizer_state_bytes() const {
    int64_t bytes = 0;
    for (const Bucket& bucket : buckets) {
      for (const at::Tensor& t : bucket.state) bytes += t.numel() * t.element_size();
      if (bucket.master.defined()) bytes += bucket.master.numel() * bucket.master.element_size();
    }
    return bytes;
  }
};

void DataParallel::parameters_changed() {
  torch::NoGradGuard no_grad;
  for (Bucket& bucket : impl_->buckets) {
    if (bucket.master.defined()) {
      bucket.master.copy_(bucket.data.narrow(0, bucket.shard_begin, bucket.shard_size()));
    }
  }
}

int64_t DataParallel::load_weights(const std::filesystem::path& ckpt_dir, int64_t step) {
  std::vector<ckpt::NamedTensor> params;
  for (const auto& p : impl_->module->named_parameters()) params.push_back({p.key(), p.value()});
  const int64_t loaded = ckpt::load_model_weights(ckpt_dir, step, params);
  parameters_changed();
  return loaded;
}

void DataParallel::Impl::install_hooks() {
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    Param& p = params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    LOOM_CHECK(p.accumulator != nullptr, InvalidArgument, "DataParallel: parameter '", p.name,
               "' has no gradient accumulator (is it a leaf?)");
    p.hook_key = p.accumulator->add_post_hook(
        std::make_unique<GradientReadyHook>([this, i] { on_gradient_accumulated(i); }));
  }
}

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group,
                           const DataParallelOptions& options)
    : DataParallel(std::move(module), group, nullptr, options) {}

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group,
                           comm::Group& control, const DataParallelOptions& options)
    : DataParallel(std::move(module), group, &control, options) {}

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group,
                           comm::Group* control, const DataParallelOptions& options) {
  LOOM_CHECK(module != nullptr, InvalidArgument, "DataParallel: module is null");
  LOOM_CHECK(options.bucket_bytes > 0, InvalidArgument, "DataParallel: bucket_bytes must be > 0");
  LOOM_CHECK(
      control == nullptr || (control->rank() == group.rank() && control->size() == group.size()),
      InvalidArgument, "DataParallel: the control group '", control->name(), "' is rank ",
      control->rank(), " of ", control->size(), " but the group '", group.name(), "' is rank ",
      group.rank(), " of ", group.size(), "; they must have the same ranks");
  impl_ = std::make_unique<Impl>(std::move(module), group, control, options);
  impl_->collect_parameters();
  impl_->check_same_parameters(options.timeout);
  impl_->build_buckets();
  impl_->move_into_buckets();
  impl_->broadcast_from_rank0(options.timeout);
  impl_->init_masters();
  impl_->install_hooks();
}

DataParallel::~DataParallel() {
  for (Param& p : impl_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

torch::nn::Module& DataParallel::module() const { return *impl_->module; }
const DataParallelOptions& DataParallel::options() const { return impl_->options; }
void DataParallel::set_sync(bool sync) { impl_->sync = sync; }
bool DataParallel::sync() const { return impl_->sync; }

DataParallel::NoSync::NoSync(DataParallel& dp) : dp_(dp), previous_(dp.sync()) {
  dp_.set_sync(false);
}
DataParallel::NoSync::~NoSync() { dp_.set_sync(previous_); }

void DataParallel::finish_gradient_sync() { impl_->finish_gradient_sync(); }
void DataParallel::reduce_accumulated_gradients() { impl_->reduce_accumulated_gradients(); }
const SyncStats& DataParallel::last_sync_stats() const { return impl_->stats; }

void DataParallel::zero_grad() {
  torch::NoGradGuard no_grad;
  for (Bucket& bucket : impl_->buckets) {
    if (impl_->sharded_gradients()) {
      bucket.grad_shard.zero_();
    } else {
      bucket.grad.zero_();
    }
  }
  if (impl_->sharded_gradients()) {  // gradients accumulated under no_sync are dropped
    for (Param& p : impl_->params) p.tensor.mutable_grad() = at::Tensor();
  }
}

double DataParallel::clip_grad_norm(double max_norm) { return impl_->clip_grad_norm(max_norm); }

void DataParallel::scale_gradients(double factor) {
  torch::NoGradGuard no_grad;
  for (Bucket& bucket : impl_->buckets) {
    (impl_->options.zero_stage == ZeroStage::kTwo ? bucket.grad_shard : bucket.grad).mul_(factor);
  }
}

void DataParallel::set_optimizer(std::unique_ptr<optim::FlatOptimizer> optimizer) {
  LOOM_CHECK(optimizer != nullptr, InvalidArgument, "DataParallel::set_optimizer: null");
  impl_->optimizer = std::move(optimizer);
  impl_->allocate_state();
  impl_->steps = 0;
}

optim::FlatOptimizer& DataParallel::optimizer() const {
  LOOM_CHECK(impl_->optimizer != nullptr, InvalidArgument, "DataParallel: no optimizer set");
  return *impl_->optimizer;
}
int64_t DataParallel::step_count() const { return impl_->steps; }
void DataParallel::step() { impl_->step(); }
void DataParallel::add_state(ckpt::State& state) { impl_->add_state(state); }
void DataParallel::load_state(const ckpt::State& state) { impl_->load_state(state); }
int64_t DataParallel::optimizer_state_bytes() const { return impl_->optimizer_state_bytes(); }
std::string DataParallel::first_non_finite_gradient() const {
  for (const Bucket& bucket : impl_->buckets) {
    for (int i : bucket.params) {
      const Param& p = impl_->params[i];
      at::Tensor grad;
      if (!impl_->sharded_gradients()) {
        grad = impl_->grad_view(p);
      } else {
        const int64_t lo = std::max(bucket.shard_begin, p.offset);
        const int64_t hi = std::min(bucket.shard_end, p.offset + p.numel);
        if (lo >= hi) continue;
        grad = bucket.grad_shard.narrow(0, lo - bucket.shard_begin, hi - lo);
      }
      if (!at::isfinite(grad).all().item<bool>()) return p.name;
    }
  }
  return "";
}

int DataParallel::bucket_count() const { return static_cast<int>(impl_->buckets.size()); }

std::vector<std::string> DataParallel::bucket_parameters(int b) const {
  LOOM_CHECK(b >= 0 && b < bucket_count(), InvalidArgument, "DataParallel: no bucket ", b);
  std::vector<std::string> names;
  for (int i : impl_->buckets[b].params) names.push_back(impl_->params[i].name);
  return names;
}

}  // namespace loom::parallel
