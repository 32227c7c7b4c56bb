// FullyShardedDataParallel: per-unit flat parameter shards, all-gathered around each unit's
// forward and backward (with prefetch), gradients reduce-scattered from gradient-accumulator
// post-hooks, and the optimizer step on the shards. See docs/parallel.md, "FSDP".
#include "loom/parallel/fsdp.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

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

// --- FsdpUnit and the wrapping policy ----------------------------------------------------------

namespace {

void check_floating(const std::optional<at::ScalarType>& dtype, const char* what) {
  LOOM_CHECK(!dtype || at::isFloatingType(*dtype), InvalidArgument, what,
             " must be a floating-point dtype, got ", util::dtype_name(dtype.value_or(at::kFloat)));
}

}  // namespace

FsdpUnitImpl::FsdpUnitImpl(torch::nn::AnyModule module, const FsdpUnitOptions& options)
    : wrapped_(std::move(module)) {
  LOOM_CHECK(!wrapped_.is_empty(), InvalidArgument, "FsdpUnit: the wrapped module is empty");
  set_options(options);
  const std::shared_ptr<torch::nn::Module> inner = wrapped_.ptr();
  LOOM_CHECK(dynamic_cast<FsdpUnitImpl*>(inner.get()) == nullptr, InvalidArgument,
             "FsdpUnit: the module is already an FsdpUnit; a module can be in one unit only");
  // Transparent names: the wrapped module's members become the unit's own.
  for (const auto& child : inner->named_children()) register_module(child.key(), child.value());
  for (const auto& p : inner->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
}

at::Tensor FsdpUnitImpl::forward(const at::Tensor& input) {
  if (hooks_ == nullptr) return wrapped_.forward(input);
  const at::Tensor cast = hooks_->before_forward(index_, input);
  return hooks_->after_forward(index_, wrapped_.forward(cast));
}

void FsdpUnitImpl::set_options(const FsdpUnitOptions& options) {
  check_floating(options.param_dtype, "FsdpUnit: param_dtype");
  check_floating(options.reduce_dtype, "FsdpUnit: reduce_dtype");
  options_ = options;
}

void FsdpUnitImpl::train(bool on) {
  torch::nn::Module::train(on);
  wrapped_.ptr()->train(on);
}

void FsdpUnitImpl::pretty_print(std::ostream& stream) const {
  stream << "loom::parallel::FsdpUnit(" << wrapped_.ptr()->name() << ")";
}

namespace detail {

int wrap_sequential(torch::nn::Sequential& sequential,
                    const std::function<bool(const std::shared_ptr<torch::nn::Module>&)>& match) {
  int wrapped = 0;
  const auto children = sequential->named_children();  // in element order
  auto element = sequential->begin();
  for (size_t i = 0; i < children.size(); ++i, ++element) {
    if (!match(element->ptr())) continue;
    auto unit = std::make_shared<FsdpUnitImpl>(*element);
    *element = torch::nn::AnyModule(unit);
    sequential->replace_module(children[i].key(), unit);
    ++wrapped;
  }
  return wrapped;
}

void replace_list_element(torch::nn::ModuleList& list, size_t index,
                          std::shared_ptr<torch::nn::Module> module) {
  *(list->begin() + static_cast<std::ptrdiff_t>(index)) = module;
  list->replace_module(std::to_string(index), module);
}

}  // namespace detail

ConfigSchema FsdpOptions::schema() {
  ConfigSchema s;
  s.add("parallel.reshard_after_forward", true,
        "fsdp: free a unit's gathered parameters after its forward (gather again in backward)");
  s.add("parallel.reduce_dtype", "",
        "fsdp: dtype of the gradient reduce-scatter and shards: empty (the parameters') or fp32");
  s.add("parallel.param_dtype", "",
        "fsdp: dtype forward and backward compute in: empty (the parameters') or bf16 (bf16 "
        "copies of fp32 shards, which stay the masters)");
  s.add("parallel.offload_optimizer_state", false,
        "fsdp: keep the optimizer state and fp32 master shards in host memory and run the "
        "update there");
  return s;
}

FsdpOptions FsdpOptions::from(const Config& config) {
  FsdpOptions o;
  o.reshard_after_forward = config.get<bool>("parallel.reshard_after_forward");
  const std::string reduce = config.get<std::string>("parallel.reduce_dtype");
  if (reduce == "fp32") {
    o.reduce_dtype = at::kFloat;
  } else {
    LOOM_CHECK(reduce.empty(), ConfigError, "parallel.reduce_dtype is '", reduce,
               "'; use fp32, or leave it empty to reduce in the parameters' dtype");
  }
  const std::string compute = config.get<std::string>("parallel.param_dtype");
  if (compute == "bf16") {
    o.param_dtype = at::kBFloat16;
  } else {
    LOOM_CHECK(compute.empty(), ConfigError, "parallel.param_dtype is '", compute,
               "'; use bf16, or leave it empty to compute in the parameters' dtype");
  }
  o.offload_optimizer_state = config.get<bool>("parallel.offload_optimizer_state");
  return o;
}

// --- the engine ---------------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;
using metrics::MemoryCategory;
using metrics::MemoryCategoryScope;
using std::chrono::milliseconds;
using util::seconds_since;

constexpr const char* kRootName = "(root)";

// What the pre-backward autograd function calls; FullyShardedDataParallel::Impl implements it.
class BackwardHooks {
 public:
  virtual ~BackwardHooks() = default;
  virtual void before_backward(int unit) = 0;
};

// Identity in forward, applied to a unit's output. Its backward runs before the backward of
// anything inside the unit (they all need the gradient of the output), so it is the unit's
// pre-backward hook: the parameters are gathered again there.
struct PreBackward : torch::autograd::Function<PreBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& output,
                            int64_t hooks, int64_t unit) {
    ctx->saved_data["hooks"] = hooks;
    ctx->saved_data["unit"] = unit;
    return output;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* hooks = reinterpret_cast<BackwardHooks*>(ctx->saved_data["hooks"].toInt());
    hooks->before_backward(static_cast<int>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

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

struct Param {
  std::string name;
  at::Tensor tensor;  // the module's parameter: a view into its unit's full buffer, or empty
  int unit = 0;
  int64_t offset = 0;  // first element in the unit's flat buffer
  int64_t numel = 0;
  std::vector<int64_t> shape;
  std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive so the hook stays on it
  uintptr_t hook_key = 0;
  bool arrived = false;  // its gradient arrived in the unit's current backward
  // Under model parallelism (placement.h): its piece of the whole model's tensor, and whether
  // this rank counts and writes it. Unset otherwise.
  std::optional<internal::Placement> placement;
};

enum class Gathered { kNo, kInFlight, kYes };

struct Unit {
  std::string name;                           // module path, or kRootName
  FsdpUnitImpl* module = nullptr;             // null for the root unit
  std::vector<int> params;                    // indices into Impl::params, in registration order
  at::ScalarType dtype = at::kFloat;          // the parameters' (and the shard's) dtype
  at::ScalarType compute_dtype = at::kFloat;  // of the full buffer: param_dtype, or dtype
  bool mixed = false;                         // a param_dtype policy applies to this unit
  int64_t numel = 0;                          // real elements
  int64_t padded = 0;                         // numel rounded up to a multiple of the world size
  int64_t shard_begin = 0;
  int64_t shard_end = 0;
  at::Tensor shard;  // this rank's slice of the parameters (parameter dtype)
  // fp32 copy of the shard: non-fp32 parameters with master weights (saved in checkpoints), and
  // every unit under offload_optimizer_state (in host memory; an fp32 one is not saved).
  at::Tensor master;
  std::vector<at::Tensor> state;             // optimizer state for the shard, fp32
  at::Tensor grad_shard;                     // the reduced gradient of the shard (grad_dtype)
  at::ScalarType reduce_dtype = at::kFloat;  // of the reduce-scatter: reduce_dtype, or compute
  at::ScalarType grad_dtype = at::kFloat;    // of grad_shard: fp32 when mixed, else reduce_dtype
  bool grad_shard_set = false;               // false: zero since zero_grad
  // The full (padded) parameters. The tensor lives as long as the unit; its storage is
  // allocated only while gathered (autograd's saved views of the parameters point into it).
  at::Tensor full;
  Gathered gathered = Gathered::kNo;
  bool gathered_by_prefetch = false;
  comm::WorkPtr gather_work;
  at::Tensor gather_input;  // the shard in compute_dtype, kept alive while the gather runs
  // Backward.
  at::Tensor full_grad;          // unsharded gradients; the parameters' .grad() are views
  bool in_backward = false;      // between its first pre-backward and its last gradient
  bool needs_backward = false;   // a forward with grad ran and resharded
  int pending = 0;               // parameters of the current backward without gradient
  bool ready_to_reduce = false;  // its gradients of the synced backward are complete
  comm::WorkPtr reduce_work;
  at::Tensor reduce_input;   // full_grad, kept alive until the reduce-scatter completes
  at::Tensor reduce_output;  // this rank's reduced slice
  bool root() const { return module == nullptr; }
  int64_t shard_size() const { return shard_end - shard_begin; }
};

int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

bool starts_with_path(const std::string& name, const std::string& prefix) {
  return prefix.empty() ||
         (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
          name[prefix.size()] == '.');
}

}  // namespace

struct FullyShardedDataParallel::Impl final : BackwardHooks {
  // Constant after construction.
  std::shared_ptr<torch::nn::Module> module;
  comm::Group& group;
  FsdpOptions options;
  int rank = 0;
  int world = 1;
  at::Device device{at::kCPU};
  std::vector<Param> params;
  std::vector<Unit> units;        // FsdpUnits in module order, then the root (if any)
  std::vector<int> reduce_order;  // units in reverse order, the root last

  // Training-thread state (one thread at a time; hooks run on the thread that runs backward).
  bool sync = true;
  size_t next_reduce = 0;  // reduce-scatters are launched in reduce_order on every rank
  bool any_gradient = false;
  std::unique_ptr<optim::FlatOptimizer> optimizer;
  int64_t steps = 0;
  FsdpStats stats;
  FsdpMemory peak;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> gradient_storages;  // full_grads

  Impl(std::shared_ptr<torch::nn::Module> m, comm::Group& g, const FsdpOptions& o)
      : module(std::move(m)), group(g), options(o), rank(g.rank()), world(g.size()) {}

  at::TensorOptions on_device(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(device);
  }
  // Whether the unit's fp32 master is state of its own, saved in checkpoints (non-fp32
  // parameters); an fp32 unit's offloaded master equals its shard.
  bool saves_master(const Unit& unit) const {
    return unit.dtype != at::kFloat && options.master_weights;
  }
  // Where the optimizer state and fp32 masters live: the device, or pinned host memory under
  // offload_optimizer_state (plain host memory when the parameters are on the CPU already).
  at::TensorOptions optimizer_options() const {
    if (!options.offload_optimizer_state) return on_device(at::kFloat);
    return at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(device.is_cuda());
  }
  std::string describe_unit(int u) const {
    const Unit& unit = units[u];
    std::string names;
    for (size_t i = 0; i < unit.params.size() && i < 4; ++i) {
      names += (i ? ", " : "") + params[unit.params[i]].name;
    }
    if (unit.params.size() > 4) names += ", ...";
    return loom::detail::concat("unit ", u, " '", unit.name, "' (", unit.params.size(),
                                " parameters: ", names, "; ", unit.numel, " elements)");
  }

  // --- construction -------------------------------------------------------------------------

  // The FsdpUnits of the module tree, with the checks that make each module and parameter
  // belong to one unit at most.
  void find_units() {
    std::unordered_map<const torch::nn::Module*, std::string> unit_at;     // unit -> its path
    std::unordered_map<const torch::nn::Module*, std::string> wrapped_by;  // inner -> unit path
    for (const auto& item : module->named_modules()) {
      auto* unit = dynamic_cast<FsdpUnitImpl*>(item.value().get());
      if (unit == nullptr) continue;
      const std::string& path = item.key();
      const auto seen = unit_at.find(unit);
      LOOM_CHECK(seen == unit_at.end(), InvalidArgument, "FSDP: the unit at '", path,
                 "' is marked twice: the same FsdpUnit is also at '",
                 seen == unit_at.end() ? "" : seen->second, "'");
      const auto twice = wrapped_by.find(unit->wrapped().get());
      LOOM_CHECK(twice == wrapped_by.end(), InvalidArgument, "FSDP: module '",
                 unit->wrapped()->name(), "' is wrapped by two units, '",
                 twice == wrapped_by.end() ? "" : twice->second, "' and '", path, "'");
      for (const Unit& outer : units) {  // named_modules lists a parent before its children
        LOOM_CHECK(!starts_with_path(path, outer.name), InvalidArgument,
                   "FSDP: units overlap: the unit '", path, "' is inside the unit '",
                   outer.name.empty() ? "(the whole model)" : outer.name, "'");
      }
      unit_at[unit] = path;
      wrapped_by[unit->wrapped().get()] = path;
      Unit u;
      u.name = path;
      u.module = unit;
      units.push_back(std::move(u));
    }
    check_modules_in_one_unit();
  }

  // The unit (index, or -1 for the root) a module path or parameter name belongs to.
  int owner_of(const std::string& name) const {
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      if (units[u].module != nullptr &&
          (units[u].name == name || starts_with_path(name, units[u].name))) {
        return u;
      }
    }
    return -1;
  }
  std::string owner_name(int u) const {
    return u < 0 ? std::string("the root unit") : "unit '" + units[u].name + "'";
  }

  void check_modules_in_one_unit() const {
    std::unordered_map<const torch::nn::Module*, std::pair<int, std::string>> owner;
    for (const auto& item : module->named_modules()) {
      if (dynamic_cast<FsdpUnitImpl*>(item.value().get()) != nullptr) continue;
      const int u = owner_of(item.key());
      const auto [it, inserted] = owner.emplace(item.value().get(), std::make_pair(u, item.key()));
      LOOM_CHECK(inserted || it->second.first == u, InvalidArgument,
                 "FSDP: units overlap: module '", item.key(), "' (also at '", it->second.second,
                 "') is in ", owner_name(u), " and in ", owner_name(it->second.first),
                 "; a module can be in one unit only");
    }
  }

  void collect_parameters() {
    std::unordered_map<const void*, std::pair<int, std::string>> owner;  // impl -> unit, name
    std::string first;
    std::map<std::string, internal::Placement> placed;
    if (options.model_parallel.active())
      placed = internal::placements(*module, options.model_parallel);
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      const at::Tensor& t = item.value();
      if (!t.requires_grad()) continue;
      const int u = owner_of(item.key());
      const auto [it, inserted] =
          owner.emplace(t.unsafeGetTensorImpl(), std::make_pair(u, item.key()));
      if (!inserted) {
        LOOM_CHECK(it->second.first == u, InvalidArgument, "FSDP: parameter '", item.key(),
                   "' (also '", it->second.second, "') is shared between ", owner_name(u), " and ",
                   owner_name(it->second.first),
                   "; a parameter must belong to one unit (wrap the modules sharing it together)");
        continue;  // tied within one unit: counted once
      }
      LOOM_CHECK(t.layout() == at::kStrided, InvalidArgument, "FSDP: parameter '", item.key(),
                 "' must be a dense (strided) tensor");
      if (first.empty()) {
        first = item.key();
        device = t.device();
      }
      LOOM_CHECK(t.device() == device, InvalidArgument, "FSDP: parameter '", item.key(), "' is on ",
                 t.device().str(), " but parameter '", first, "' is on ", device.str(),
                 "; move the whole module to one device first");
      Param p;
      p.name = item.key();
      p.tensor = t;
      p.numel = t.numel();
      p.shape = t.sizes().vec();
      p.unit = u;
      if (const auto it = placed.find(p.name); it != placed.end()) p.placement = it->second;
      params.push_back(std::move(p));
    }
    // Units without (trainable) parameters are dropped: their modules run unhooked. The root
    // unit holds what no unit holds.
    std::vector<int> renumbered(units.size(), -1);
    std::vector<Unit> kept;
    for (const Param& p : params) {
      if (p.unit >= 0 && renumbered[p.unit] < 0) renumbered[p.unit] = 0;
    }
    for (size_t u = 0; u < units.size(); ++u) {
      if (renumbered[u] < 0) continue;
      renumbered[u] = static_cast<int>(kept.size());
      kept.push_back(std::move(units[u]));
    }
    units = std::move(kept);
    const int root = static_cast<int>(units.size());
    bool has_root = false;
    for (Param& p : params) {
      p.unit = p.unit < 0 ? root : renumbered[p.unit];
      has_root = has_root || p.unit == root;
    }
    if (has_root) {
      Unit r;
      r.name = kRootName;
      units.push_back(std::move(r));
    }
    for (int i = 0; i < static_cast<int>(params.size()); ++i)
      units[params[i].unit].params.push_back(i);
    for (Unit& unit : units) {
      for (int i : unit.params) {
        LOOM_CHECK(params[i].tensor.scalar_type() == params[unit.params[0]].tensor.scalar_type(),
                   InvalidArgument, "FSDP: ", unit.name, " mixes dtypes: parameter '",
                   params[i].name, "' is ", util::dtype_name(params[i].tensor.scalar_type()),
                   ", parameter '", params[unit.params[0]].name, "' is ",
                   util::dtype_name(params[unit.params[0]].tensor.scalar_type()));
      }
    }
  }

  // As DataParallel: every rank compares every rank's signature with rank 0's, so that all
  // ranks throw alike. One line per parameter: name|dtype|shape|unit.
  void check_same_parameters() {
    const milliseconds timeout = options.timeout;
    std::string mine;
    for (const Param& p : params) {
      mine += p.name + "|" + util::dtype_name(p.tensor.scalar_type()) + "|" +
              shape_string(p.tensor.sizes()) + "|" + units[p.unit].name + "\n";
    }
    const auto lines = comm::internal::all_gather_lines(group, mine, device, timeout);
    auto text_of = [&](int r) { return lines[static_cast<size_t>(r)]; };
    const std::vector<std::string> reference = text_of(0);
    for (int r = 1; r < world; ++r) {
      const std::vector<std::string> other = text_of(r);
      for (size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
        const std::string a = i < reference.size() ? reference[i] : "(none)";
        const std::string b = i < other.size() ? other[i] : "(none)";
        if (a != b) {
          throw InvalidArgument(loom::detail::concat(
              "FSDP: rank ", r, "'s parameters differ from rank 0's at parameter ", i,
              " (name|dtype|shape|unit): rank 0 has '", a, "', rank ", r, " has '", b,
              "'. Every rank must build the same model and the same units."));
        }
      }
    }
  }

  void build_units() {
    torch::NoGradGuard no_grad;
    const Clock::time_point deadline = Clock::now() + options.timeout;
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      Unit& unit = units[u];
      unit.dtype = params[unit.params[0]].tensor.scalar_type();
      for (int i : unit.params) {
        params[i].offset = unit.numel;
        unit.numel += params[i].numel;
      }
      unit.padded = (unit.numel + world - 1) / world * world;
      const int64_t chunk = unit.padded / world;
      unit.shard_begin = rank * chunk;
      unit.shard_end = (rank + 1) * chunk;
      set_policy(unit);
      MemoryCategoryScope parameters(MemoryCategory::kParameters);
      at::Tensor flat = at::zeros({unit.padded}, on_device(unit.dtype));
      for (int i : unit.params) {
        flat.narrow(0, params[i].offset, params[i].numel)
            .view(params[i].shape)
            .copy_(params[i].tensor);
      }
      group.broadcast(flat, {.root = 0, .timeout = options.timeout})
          ->wait(util::time_left(deadline));
      unit.shard = flat.narrow(0, unit.shard_begin, unit.shard_size()).clone();
      unit.full = unit.compute_dtype == unit.dtype ? flat : flat.to(unit.compute_dtype);
      flat = at::Tensor();
      if (saves_master(unit) || options.offload_optimizer_state) {
        MemoryCategoryScope state(MemoryCategory::kOptimizerState);
        unit.master = at::empty({unit.shard_size()}, optimizer_options());
        unit.master.copy_(unit.shard);
      }
      {
        MemoryCategoryScope gradients(MemoryCategory::kGradients);
        unit.grad_shard = at::zeros({unit.shard_size()}, on_device(unit.grad_dtype));
      }
      unit.gathered = Gathered::kYes;
      install_views(unit);
    }
    for (int u = static_cast<int>(units.size()) - 1; u >= 0; --u) {
      if (!units[u].root()) reduce_order.push_back(u);
    }
    if (!units.empty() && units.back().root())
      reduce_order.push_back(static_cast<int>(units.size()) - 1);
    for (at::Tensor buffer : module->buffers(/*recurse=*/true)) {
      at::Tensor contiguous =
          buffer.scalar_type() == at::kBool ? buffer.to(at::kByte) : buffer.contiguous();
      group.broadcast(contiguous, {.root = 0, .timeout = options.timeout})
          ->wait(util::time_left(deadline));
      if (!contiguous.is_same(buffer)) buffer.copy_(contiguous);
    }
  }

  // The unit's dtypes: its FsdpUnitOptions field by field over FsdpOptions.
  void set_policy(Unit& unit) const {
    const FsdpUnitOptions own = unit.root() ? FsdpUnitOptions{} : unit.module->options();
    const std::optional<at::ScalarType> param_dtype =
        own.param_dtype ? own.param_dtype : options.param_dtype;
    unit.compute_dtype = param_dtype.value_or(unit.dtype);
    unit.mixed = param_dtype.has_value();
    if (own.reduce_dtype) {
      unit.reduce_dtype = *own.reduce_dtype;
    } else if (own.param_dtype) {
      unit.reduce_dtype = *own.param_dtype;
    } else {
      unit.reduce_dtype = options.reduce_dtype.value_or(unit.compute_dtype);
    }
    unit.grad_dtype = unit.mixed ? at::kFloat : unit.reduce_dtype;
  }

  void install_hooks() {
    for (int i = 0; i < static_cast<int>(params.size()); ++i) {
      Param& p = params[i];
      p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
      LOOM_CHECK(p.accumulator != nullptr, InvalidArgument, "FSDP: parameter '", p.name,
                 "' has no gradient accumulator (is it a leaf?)");
      p.hook_key = p.accumulator->add_post_hook(
          std::make_unique<GradientReadyHook>([this, i] { on_gradient_accumulated(i); }));
    }
  }

  // --- gathering and freeing parameters -------------------------------------------------------

  at::Tensor full_view(const Unit& unit, const Param& p) const {
    return unit.full.narrow(0, p.offset, p.numel).view(p.shape);
  }

  void install_views(Unit& unit) {
    for (int i : unit.params) params[i].tensor.set_data(full_view(unit, params[i]));
  }

  // Gives the full buffer's storage memory again (after release_full_storage).
  void allocate_full_storage(Unit& unit) {
    c10::StorageImpl* storage = unit.full.storage().unsafeGetStorageImpl();
    const size_t bytes = static_cast<size_t>(bytes_of(unit.full));
    if (storage->nbytes() == bytes) return;
    MemoryCategoryScope parameters(MemoryCategory::kParameters);
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
    storage->set_nbytes(bytes);
    note_memory();
  }

  // Frees the full buffer's memory. Resizing the storage itself (as PyTorch's FSDP does with
  // storage().resize_(0)) releases it even though autograd's saved views of the parameters
  // (e.g. weight.t() saved by addmm) still point to it; those views read the re-gathered
  // memory in backward. Dropping our references alone would free nothing while they live.
  void release_full_storage(Unit& unit) {
    c10::StorageImpl* storage = unit.full.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, unit.full.device()));
    storage->set_nbytes(0);
  }

  void launch_gather(int u, bool prefetch) {
    Unit& unit = units[u];
    if (unit.gathered != Gathered::kNo) return;
    allocate_full_storage(unit);
    unit.gather_input =
        unit.compute_dtype == unit.dtype ? unit.shard : unit.shard.to(unit.compute_dtype);
    unit.gather_work = group.all_gather(unit.full, unit.gather_input, {options.timeout});
    unit.gathered = Gathered::kInFlight;
    unit.gathered_by_prefetch = prefetch;
    ++stats.all_gathers;
  }

  void wait_gather(int u, const char* why) {
    Unit& unit = units[u];
    launch_gather(u, /*prefetch=*/false);
    if (unit.gathered == Gathered::kInFlight) {
      const Clock::time_point start = Clock::now();
      try {
        unit.gather_work->wait(options.timeout);
        stats.gather_wait_seconds += seconds_since(start);
      } catch (const Timeout& e) {
        throw Timeout(loom::detail::concat("FSDP on rank ", rank, ": gathering the parameters of ",
                                           describe_unit(u), " for ", why, " timed out (", e.what(),
                                           ")"));
      } catch (const CommError& e) {
        throw CommError(loom::detail::concat("FSDP on rank ", rank,
                                             ": gathering the parameters of ", describe_unit(u),
                                             " for ", why, " failed: ", e.what()));
      }
      unit.gather_work.reset();
      unit.gather_input = at::Tensor();
      unit.gathered = Gathered::kYes;
    }
    install_views(unit);
  }

  void free_full(int u) {
    Unit& unit = units[u];
    if (unit.gathered == Gathered::kNo) return;
    if (unit.gathered == Gathered::kInFlight) wait_gather(u, "freeing");
    // In the compute dtype: set_data to another dtype would drop the gradient accumulators.
    for (int i : unit.params) {
      params[i].tensor.set_data(at::empty({0}, on_device(unit.compute_dtype)));
    }
    release_full_storage(unit);
    unit.gathered = Gathered::kNo;
    unit.gathered_by_prefetch = false;
  }

  // --- forward and backward -------------------------------------------------------------------

  at::Tensor before_forward(int u, const at::Tensor& input) {
    Unit& unit = units[u];
    if (unit.gathered != Gathered::kNo && unit.gathered_by_prefetch) ++stats.forward_prefetched;
    launch_gather(u, /*prefetch=*/false);
    const int next = u + 1;
    if (options.prefetch && next < static_cast<int>(units.size()) && !units[next].root()) {
      launch_gather(next, /*prefetch=*/true);
    }
    wait_gather(u, "forward");
    if (unit.mixed && input.is_floating_point() && input.scalar_type() != unit.compute_dtype) {
      return input.to(unit.compute_dtype);
    }
    return input;
  }

  at::Tensor after_forward(int u, at::Tensor output) {
    Unit& unit = units[u];
    if (torch::GradMode::is_enabled() && output.requires_grad()) {
      output =
          PreBackward::apply(output, reinterpret_cast<int64_t>(static_cast<BackwardHooks*>(this)),
                             static_cast<int64_t>(u));
      unit.needs_backward = true;
    }
    if (options.reshard_after_forward) free_full(u);
    return output;
  }

  void before_backward(int u) override {
    Unit& unit = units[u];
    if (unit.gathered != Gathered::kNo && unit.gathered_by_prefetch) ++stats.backward_prefetched;
    launch_gather(u, /*prefetch=*/false);
    for (int previous = u - 1; options.prefetch && previous >= 0; --previous) {
      if (units[previous].needs_backward) {
        launch_gather(previous, /*prefetch=*/true);
        break;
      }
    }
    wait_gather(u, "backward");
    begin_backward(unit);
  }

  // The unit's gradients accumulate in place into one flat buffer (kept across micro-steps
  // under no_sync).
  void begin_backward(Unit& unit) {
    if (unit.in_backward) return;
    torch::NoGradGuard no_grad;
    unit.in_backward = true;
    unit.pending = static_cast<int>(unit.params.size());
    if (!unit.full_grad.defined()) {
      MemoryCategoryScope gradients(MemoryCategory::kGradients);
      unit.full_grad = at::zeros({unit.padded}, on_device(unit.compute_dtype));
      gradient_storages.push_back(unit.full_grad.storage().getWeakStorageImpl());
      note_memory();
    }
    for (int i : unit.params) {
      params[i].arrived = false;
      params[i].tensor.mutable_grad() = grad_view(unit, params[i]);
    }
  }

  at::Tensor grad_view(const Unit& unit, const Param& p) const {
    return unit.full_grad.narrow(0, p.offset, p.numel).view(p.shape);
  }

  void on_gradient_accumulated(int index) {
    Param& p = params[index];
    Unit& unit = units[p.unit];
    if (unit.root()) {
      on_root_gradient(p, p.unit);
      return;
    }
    const at::Tensor grad = p.tensor.grad();
    begin_backward(unit);
    internal::adopt_gradient(p.tensor, grad, grad_view(unit, p));
    LOOM_CHECK(!p.arrived, InvalidArgument, "FSDP on rank ", rank, ": parameter '", p.name,
               "' got a second gradient before the other parameters of ", describe_unit(p.unit),
               " got theirs; every parameter of a unit must get a gradient in every backward");
    p.arrived = true;
    if (--unit.pending == 0) end_backward(p.unit);
  }

  // The root unit has no pre-backward, and its parameters are often used first and last (an
  // embedding whose weight the head reuses: its gradient is complete only at the very end of
  // backward). Its gradients therefore stay autograd's own tensors until the last of them has
  // arrived and only then move into the unit's flat buffer (added, under no_sync), so that the
  // root's unsharded gradient buffer does not exist while the other units run backward.
  void on_root_gradient(Param& p, int u) {
    Unit& unit = units[u];
    if (!unit.in_backward) {
      unit.in_backward = true;
      unit.pending = static_cast<int>(unit.params.size());
      for (int i : unit.params) params[i].arrived = false;
    }
    LOOM_CHECK(!p.arrived, InvalidArgument, "FSDP on rank ", rank, ": parameter '", p.name,
               "' got a second gradient before the other parameters of ", describe_unit(u),
               " got theirs; every parameter of a unit must get a gradient in every backward");
    p.arrived = true;
    if (--unit.pending > 0) return;
    torch::NoGradGuard no_grad;
    const bool fresh = !unit.full_grad.defined();
    if (fresh) {
      MemoryCategoryScope gradients(MemoryCategory::kGradients);
      unit.full_grad = at::empty({unit.padded}, on_device(unit.compute_dtype));
      unit.full_grad.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
      gradient_storages.push_back(unit.full_grad.storage().getWeakStorageImpl());
    }
    for (int i : unit.params) {
      const at::Tensor view = grad_view(unit, params[i]);
      const at::Tensor grad = params[i].tensor.grad();
      if (!grad.defined()) {
        if (fresh) view.zero_();
      } else if (fresh) {
        view.copy_(grad);
      } else {
        view.add_(grad);
      }
      params[i].tensor.mutable_grad() = at::Tensor();  // autograd's tensor is released here
    }
    note_memory();
    end_backward(u);
  }

  void end_backward(int u) {
    Unit& unit = units[u];
    unit.in_backward = false;
    unit.needs_backward = false;
    any_gradient = true;
    if (sync) {
      unit.ready_to_reduce = true;
      launch_ready_reductions(/*during_backward=*/true);
    }
    if (!unit.root()) free_full(u);
  }

  void launch_ready_reductions(bool during_backward) {
    while (next_reduce < reduce_order.size() && units[reduce_order[next_reduce]].ready_to_reduce) {
      launch_reduce(reduce_order[next_reduce++]);
      if (during_backward) ++stats.reduce_scatters_in_backward;
    }
    // Release what has already arrived, so that unsharded gradients do not pile up.
    for (int u : reduce_order) {
      if (units[u].reduce_work && units[u].reduce_work->is_completed())
        complete_reduce(u, Clock::now());
    }
  }

  void launch_reduce(int u) {
    // One reduce-scatter in flight at a time: the previous unit's overlapped this unit's
    // backward, so it has usually arrived; finishing it here frees its unsharded gradient
    // before this one waits, so at most two units' unsharded gradients exist at once.
    for (int older : reduce_order) {
      if (older != u && units[older].reduce_work)
        complete_reduce(older, Clock::now() + options.timeout);
    }
    Unit& unit = units[u];
    MemoryCategoryScope gradients(MemoryCategory::kGradients);
    for (int i : unit.params) params[i].tensor.mutable_grad() = at::Tensor();
    if (unit.full_grad.scalar_type() == unit.reduce_dtype) {
      unit.reduce_input = std::move(unit.full_grad);
    } else {  // a reduce dtype of its own: converted once, then the unit's buffer is freed
      unit.reduce_input = unit.full_grad.to(unit.reduce_dtype);
      gradient_storages.push_back(unit.reduce_input.storage().getWeakStorageImpl());
      note_memory();
    }
    unit.full_grad = at::Tensor();
    unit.reduce_output = at::empty({unit.shard_size()}, on_device(unit.reduce_dtype));
    note_memory();
    unit.reduce_work = group.reduce_scatter(unit.reduce_output, unit.reduce_input,
                                            {comm::ReduceOp::kAvg, options.timeout});
    ++stats.reduce_scatters;
  }

  void complete_reduce(int u, Clock::time_point deadline) {
    Unit& unit = units[u];
    const Clock::time_point start = Clock::now();
    try {
      unit.reduce_work->wait(util::time_left(deadline));
      stats.reduce_wait_seconds += seconds_since(start);
    } catch (const Timeout& e) {
      throw Timeout(loom::detail::concat(
          "FSDP on rank ", rank, ": the reduce-scatter of ", describe_unit(u),
          " did not finish within ", options.timeout.count(),
          " ms; did a peer skip backward or finish_gradient_sync? (", e.what(), ")"));
    } catch (const CommError& e) {
      throw CommError(loom::detail::concat("FSDP on rank ", rank, ": the reduce-scatter of ",
                                           describe_unit(u), " failed: ", e.what()));
    }
    torch::NoGradGuard no_grad;
    if (unit.grad_shard_set) {
      unit.grad_shard.add_(unit.reduce_output);
    } else {
      unit.grad_shard.copy_(unit.reduce_output);
    }
    unit.grad_shard_set = true;
    unit.reduce_work.reset();
    unit.reduce_input = at::Tensor();
    unit.reduce_output = at::Tensor();
  }

  void finish_gradient_sync() {
    if (!sync) return;
    struct Reset {
      Impl* impl;
      ~Reset() { impl->reset_sync_window(); }
    } reset{this};
    LOOM_CHECK(any_gradient || params.empty(), InvalidArgument,
               "FSDP::finish_gradient_sync on rank ", rank,
               ": no gradient arrived since the last sync; run backward (with sync on) first");
    for (int u : reduce_order) {
      const Unit& unit = units[u];
      if (unit.ready_to_reduce) continue;
      std::string missing;
      int count = 0;
      for (int i : unit.params) {
        if (unit.in_backward && params[i].arrived) continue;
        if (count++ < 8) missing += (missing.empty() ? "" : ", ") + params[i].name;
      }
      throw InvalidArgument(loom::detail::concat(
          "FSDP on rank ", rank, ": ", count, " parameter(s) of ", describe_unit(u),
          " got no gradient in this backward: ", missing, (count > 8 ? ", ..." : ""),
          ". Make the loss depend on them or freeze them (requires_grad = false) before "
          "building FSDP"));
    }
    launch_ready_reductions(/*during_backward=*/false);
    const Clock::time_point deadline = Clock::now() + options.timeout;
    for (int u : reduce_order) {
      if (units[u].reduce_work) complete_reduce(u, deadline);
    }
  }

  void reduce_accumulated_gradients() {
    torch::NoGradGuard no_grad;
    std::vector<std::pair<at::Tensor, comm::Group*>> tied;
    for (const Param& p : params) {
      if (!p.placement || p.placement->tied == nullptr) continue;
      const Unit& unit = units[p.unit];
      LOOM_CHECK(unit.full_grad.defined(), InvalidArgument, "FSDP on rank ", rank,
                 ": the tied parameter '", p.name,
                 "' got no gradient before reduce_accumulated_gradients");
      tied.emplace_back(grad_view(unit, p), p.placement->tied);
    }
    internal::sum_tied_gradients(tied, options.timeout);
    sync = true;
    for (int u : reduce_order) {
      Unit& unit = units[u];
      LOOM_CHECK(unit.full_grad.defined() && !unit.in_backward, InvalidArgument, "FSDP on rank ",
                 rank, ": ", describe_unit(u),
                 " has no complete accumulated gradient; run every backward under no_sync() "
                 "before reduce_accumulated_gradients");
      unit.ready_to_reduce = true;
    }
    any_gradient = any_gradient || !units.empty();
    launch_ready_reductions(/*during_backward=*/false);
  }

  void reset_sync_window() {
    for (Unit& unit : units) unit.ready_to_reduce = false;
    next_reduce = 0;
    any_gradient = false;
  }

  void zero_grad() {
    torch::NoGradGuard no_grad;
    for (Unit& unit : units) {
      unit.grad_shard.zero_();
      unit.grad_shard_set = false;
      if (unit.full_grad.defined() && !unit.in_backward) {
        for (int i : unit.params) params[i].tensor.mutable_grad() = at::Tensor();
        unit.full_grad = at::Tensor();
      }
    }
  }

  // --- clipping and the optimizer -------------------------------------------------------------

  double clip_grad_norm(double max_norm) {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> shards;
    for (Unit& unit : units) {
      if (!options.model_parallel.active()) {
        shards.push_back(unit.grad_shard);
        continue;
      }
      // Only the parameters this rank counts (placement.h), each one's part of the shard.
      for (int i : unit.params) {
        const Param& p = params[i];
        const int64_t lo = std::max(unit.shard_begin, p.offset);
        const int64_t hi = std::min(unit.shard_end, p.offset + p.numel);
        if (lo < hi && p.placement->primary)
          shards.push_back(unit.grad_shard.narrow(0, lo - unit.shard_begin, hi - lo));
      }
    }
    at::Tensor total = shards.empty() ? at::zeros({1}, on_device(at::kDouble))
                                      : optim::internal::sum_of_squares(shards);
    group.all_reduce(total, {comm::ReduceOp::kSum, options.timeout})->wait(options.timeout);
    if (options.model_parallel.active())
      internal::sum_over_model(total, options.model_parallel, options.timeout);
    const double norm = std::sqrt(total.item<double>());
    // As torch::nn::utils::clip_grad_norm_ and DataParallel: the coefficient in float.
    const double coefficient = std::min(
        1.0,
        static_cast<double>(static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f)));
    if (coefficient < 1.0) {
      for (Unit& unit : units) unit.grad_shard.mul_(coefficient);
    }
    return norm;
  }

  // As DataParallel: the element-wise update over 64K-element pieces of the shard on the CPU
  // (cache-sized passes; the same arithmetic per element).
  void update_in_chunks(const at::Tensor& target, const at::Tensor& grads,
                        std::vector<at::Tensor>& state) {
    if (!target.is_cpu()) {
      optimizer->update(target, grads, state, steps);
      return;
    }
    constexpr int64_t kChunk = 64 * 1024;
    const int64_t n = target.numel();
    std::vector<at::Tensor> piece(state.size());
    for (int64_t at = 0; at < n; at += kChunk) {
      const int64_t len = std::min(kChunk, n - at);
      for (size_t i = 0; i < state.size(); ++i) piece[i] = state[i].narrow(0, at, len);
      optimizer->update(target.narrow(0, at, len), grads.narrow(0, at, len), piece, steps);
    }
  }

  void wait_gathers_in_flight(const char* why) {
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      if (units[u].gathered == Gathered::kInFlight) wait_gather(u, why);
    }
  }

  // Finishes in-flight gathers (they read the shards) and frees unit parameters: they are
  // stale once the shards change. The root is gathered again.
  void refresh_after_shards_changed() {
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      if (units[u].root()) continue;
      free_full(u);
    }
    if (!units.empty() && units.back().root()) {
      const int r = static_cast<int>(units.size()) - 1;
      free_full(r);
      wait_gather(r, "the root unit after the shards changed");
    }
  }

  void step() {
    LOOM_CHECK(optimizer != nullptr, InvalidArgument,
               "FSDP::step: no optimizer; call set_optimizer first");
    torch::NoGradGuard no_grad;
    wait_gathers_in_flight("the optimizer step");
    ++steps;
    for (Unit& unit : units) {
      at::Tensor grad = unit.grad_shard;
      if (grad.scalar_type() != at::kFloat) grad = grad.to(at::kFloat);
      if (unit.master.defined() && grad.device() != unit.master.device()) {
        grad = grad.to(unit.master.device());  // offload: the update runs on the host
      }
      if (unit.master.defined()) {
        update_in_chunks(unit.master, grad, unit.state);
        unit.shard.copy_(unit.master);
      } else if (unit.dtype == at::kFloat) {
        update_in_chunks(unit.shard, grad, unit.state);
      } else {
        at::Tensor fp32 = unit.shard.to(at::kFloat);
        update_in_chunks(fp32, grad, unit.state);
        unit.shard.copy_(fp32);
      }
    }
    refresh_after_shards_changed();
  }

  void allocate_state() {
    MemoryCategoryScope state(MemoryCategory::kOptimizerState);
    for (Unit& unit : units) {
      unit.state.clear();
      for (size_t i = 0; i < optimizer->state_names().size(); ++i) {
        unit.state.push_back(at::zeros({unit.shard_size()}, optimizer_options()));
      }
    }
    note_memory();
  }

  std::map<std::string, at::Tensor> gather_full_parameters() {
    torch::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> out;
    for (Unit& unit : units) {
      at::Tensor full = at::empty({unit.padded}, on_device(unit.dtype));
      group.all_gather(full, unit.shard, {options.timeout})->wait(options.timeout);
      for (int i : unit.params) {
        const Param& p = params[i];
        out[p.name] = full.narrow(0, p.offset, p.numel).view(p.shape).clone();
      }
    }
    return out;
  }

  // --- checkpoint state -----------------------------------------------------------------------

  // Elements [lo, hi) of p: of the whole parameter, or of its piece of the whole model's.
  static ckpt::Sharding part(const Param& p, int64_t lo, int64_t hi) {
    return p.placement ? p.placement->piece.part(lo, hi) : ckpt::Sharding::flat(p.shape, lo, hi);
  }

  template <typename Fn>
  void for_each_state_tensor(Fn&& fn) {
    const std::vector<std::string> names =
        optimizer ? optimizer->state_names() : std::vector<std::string>{};
    auto for_each_piece = [&](auto&& describe) {
      for (Param& p : params) {
        Unit& unit = units[p.unit];
        const int64_t lo = std::max(unit.shard_begin, p.offset);
        const int64_t hi = std::min(unit.shard_end, p.offset + p.numel);
        describe(p, unit, lo, hi);
      }
    };
    auto piece_of = [&](const std::string& name, const Param& p, const Unit& unit, int64_t lo,
                        int64_t hi, const at::Tensor& shard_tensor) {
      if (lo >= hi) {  // this rank owns none of p: an empty piece, as DataParallel
        const int64_t at = std::clamp<int64_t>(unit.shard_begin - p.offset, 0, p.numel);
        fn(name, at::empty({0}, shard_tensor.options()), part(p, at, at));
        return;
      }
      fn(name, shard_tensor.narrow(0, lo - unit.shard_begin, hi - lo),
         part(p, lo - p.offset, hi - p.offset));
    };
    for_each_piece([&](const Param& p, const Unit& unit, int64_t lo, int64_t hi) {
      piece_of("model/" + p.name, p, unit, lo, hi, unit.shard);
    });
    for_each_piece([&](const Param& p, const Unit& unit, int64_t lo, int64_t hi) {
      for (size_t i = 0; i < names.size() && i < unit.state.size(); ++i) {
        piece_of("optim/" + p.name + "/" + names[i], p, unit, lo, hi, unit.state[i]);
      }
      if (saves_master(unit)) piece_of("optim/" + p.name + "/master", p, unit, lo, hi, unit.master);
    });
  }

  void add_state(ckpt::State& state) {
    for_each_state_tensor([&](const std::string& name, const at::Tensor& t,
                              const ckpt::Sharding& sharding) { state.add(name, t, sharding); });
    nlohmann::json blob;
    blob["optimizer"] = optimizer ? optimizer->name() : "";
    blob["step"] = steps;
    blob["mode"] = "fsdp";
    state.blobs["optim"] = blob.dump();
  }

  void load_state(const ckpt::State& source) {
    std::map<std::string, const ckpt::TensorEntry*> by_name;
    for (const ckpt::TensorEntry& entry : source.tensors) by_name[entry.name] = &entry;
    const int64_t saved_steps =
        internal::read_optim_blob(source, optimizer.get(), "FSDP::load_state");
    torch::NoGradGuard no_grad;
    wait_gathers_in_flight("loading state");
    for_each_state_tensor([&](const std::string& name, const at::Tensor& t,
                              const ckpt::Sharding& sharding) {
      const auto it = by_name.find(name);
      LOOM_CHECK(it != by_name.end(), InvalidArgument, "FSDP::load_state: no tensor '", name,
                 "' in the state");
      const ckpt::TensorEntry& entry = *it->second;
      LOOM_CHECK(entry.tensor.numel() == t.numel() && entry.sharding.begin == sharding.begin &&
                     entry.sharding.end == sharding.end,
                 InvalidArgument, "FSDP::load_state: '", name, "' holds ", entry.tensor.numel(),
                 " elements [", entry.sharding.begin, ", ", entry.sharding.end,
                 "), this rank needs ", t.numel(), " [", sharding.begin, ", ", sharding.end, ")");
      if (entry.tensor.data_ptr() != t.data_ptr()) t.copy_(entry.tensor.reshape(t.sizes()));
    });
    steps = saved_steps;
    for (Unit& unit : units) {
      if (saves_master(unit)) {
        unit.shard.copy_(unit.master);
      } else if (unit.master.defined()) {
        unit.master.copy_(unit.shard);  // an offloaded fp32 master is its shard
      }
    }
    refresh_after_shards_changed();
  }

  int64_t load_weights(const std::filesystem::path& ckpt_dir, int64_t step) {
    std::map<std::string, at::Tensor> full = gather_full_parameters();
    std::vector<ckpt::NamedTensor> named;
    for (const auto& [name, tensor] : full) named.push_back({name, tensor});
    for (const auto& item : module->named_parameters()) {  // frozen ones are not sharded
      if (!item.value().requires_grad()) named.push_back({item.key(), item.value()});
    }
    const int64_t loaded = ckpt::load_model_weights(ckpt_dir, step, named);
    torch::NoGradGuard no_grad;
    wait_gathers_in_flight("loading weights");
    for (const Param& p : params) {
      Unit& unit = units[p.unit];
      const int64_t lo = std::max(unit.shard_begin, p.offset);
      const int64_t hi = std::min(unit.shard_end, p.offset + p.numel);
      if (lo >= hi) continue;
      unit.shard.narrow(0, lo - unit.shard_begin, hi - lo)
          .copy_(full.at(p.name).reshape(-1).narrow(0, lo - p.offset, hi - lo));
    }
    for (Unit& unit : units) {
      if (unit.master.defined()) unit.master.copy_(unit.shard);
    }
    refresh_after_shards_changed();
    return loaded;
  }

  std::string first_non_finite_gradient() const {
    for (const Param& p : params) {
      const Unit& unit = units[p.unit];
      const int64_t lo = std::max(unit.shard_begin, p.offset);
      const int64_t hi = std::min(unit.shard_end, p.offset + p.numel);
      if (lo >= hi) continue;
      const at::Tensor grad = unit.grad_shard.narrow(0, lo - unit.shard_begin, hi - lo);
      if (!at::isfinite(grad).all().item<bool>()) return p.name;
    }
    return "";
  }

  // --- memory accounting ----------------------------------------------------------------------

  FsdpMemory memory() const {
    FsdpMemory m;
    for (const Unit& unit : units) {
      m.parameter_bytes += bytes_of(unit.shard);
      if (!unit.gather_input.is_same(unit.shard)) m.parameter_bytes += bytes_of(unit.gather_input);
      m.parameter_bytes += static_cast<int64_t>(unit.full.storage().nbytes());
      m.gradient_bytes += bytes_of(unit.grad_shard) + bytes_of(unit.reduce_output);
      int64_t& optimizer =
          options.offload_optimizer_state ? m.offloaded_optimizer_bytes : m.optimizer_bytes;
      for (const at::Tensor& t : unit.state) optimizer += bytes_of(t);
      optimizer += bytes_of(unit.master);
    }
    for (const auto& weak : gradient_storages) {
      if (auto storage = weak.lock()) m.gradient_bytes += static_cast<int64_t>(storage->nbytes());
    }
    return m;
  }

  void note_memory() {
    gradient_storages.erase(std::remove_if(gradient_storages.begin(), gradient_storages.end(),
                                           [](const auto& weak) { return weak.expired(); }),
                            gradient_storages.end());
    const FsdpMemory now = memory();
    if (now.total() > peak.total()) peak = now;
  }

  int64_t optimizer_state_bytes() const {
    const FsdpMemory m = memory();
    return m.optimizer_bytes + m.offloaded_optimizer_bytes;
  }
};

// --- FullyShardedDataParallel -------------------------------------------------------------------

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   comm::Group& group, const FsdpOptions& options) {
  LOOM_CHECK(module != nullptr, InvalidArgument, "FSDP: module is null");
  check_floating(options.param_dtype, "FSDP: param_dtype");
  check_floating(options.reduce_dtype, "FSDP: reduce_dtype");
  impl_ = std::make_unique<Impl>(std::move(module), group, options);
  impl_->find_units();
  impl_->collect_parameters();
  impl_->check_same_parameters();
  impl_->build_units();
  impl_->install_hooks();  // while the parameters have their full shapes
  for (int u = 0; u < static_cast<int>(impl_->units.size()); ++u) {
    Unit& unit = impl_->units[u];
    if (unit.root()) continue;
    unit.module->hooks_ = this;
    unit.module->index_ = u;
    impl_->free_full(u);
  }
  // Units without parameters (all frozen) were not kept; their modules run unhooked.
  impl_->note_memory();
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (Unit& unit : impl_->units) {
    if (unit.module != nullptr) unit.module->hooks_ = nullptr;
    for (comm::WorkPtr* work : {&unit.gather_work, &unit.reduce_work}) {
      if (!*work) continue;
      try {
        (*work)->wait(impl_->options.timeout);
      } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): only releasing tensors
      }
    }
  }
  for (Param& p : impl_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

at::Tensor FullyShardedDataParallel::before_forward(int unit, const at::Tensor& input) {
  return impl_->before_forward(unit, input);
}
at::Tensor FullyShardedDataParallel::after_forward(int unit, at::Tensor output) {
  return impl_->after_forward(unit, std::move(output));
}

torch::nn::Module& FullyShardedDataParallel::module() const { return *impl_->module; }
const FsdpOptions& FullyShardedDataParallel::options() const { return impl_->options; }
void FullyShardedDataParallel::set_sync(bool sync) { impl_->sync = sync; }
bool FullyShardedDataParallel::sync() const { return impl_->sync; }

FullyShardedDataParallel::NoSync::NoSync(FullyShardedDataParallel& fsdp)
    : fsdp_(fsdp), previous_(fsdp.sync()) {
  fsdp_.set_sync(false);
}
FullyShardedDataParallel::NoSync::~NoSync() { fsdp_.set_sync(previous_); }

void FullyShardedDataParallel::finish_gradient_sync() { impl_->finish_gradient_sync(); }
void FullyShardedDataParallel::reduce_accumulated_gradients() {
  impl_->reduce_accumulated_gradients();
}
void FullyShardedDataParallel::zero_grad() { impl_->zero_grad(); }
double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  return impl_->clip_grad_norm(max_norm);
}

void FullyShardedDataParallel::scale_gradients(double factor) {
  torch::NoGradGuard no_grad;
  for (Unit& unit : impl_->units) unit.grad_shard.mul_(factor);
}
std::string FullyShardedDataParallel::first_non_finite_gradient() const {
  return impl_->first_non_finite_gradient();
}
int64_t FullyShardedDataParallel::load_weights(const std::filesystem::path& ckpt_dir,
                                               int64_t step) {
  return impl_->load_weights(ckpt_dir, step);
}
void FullyShardedDataParallel::set_optimizer(std::unique_ptr<optim::FlatOptimizer> optimizer) {
  LOOM_CHECK(optimizer != nullptr, InvalidArgument, "FSDP::set_optimizer: null");
  impl_->optimizer = std::move(optimizer);
  impl_->allocate_state();
  impl_->steps = 0;
}

optim::FlatOptimizer& FullyShardedDataParallel::optimizer() const {
  LOOM_CHECK(impl_->optimizer != nullptr, InvalidArgument, "FSDP: no optimizer set");
  return *impl_->optimizer;
}
int64_t FullyShardedDataParallel::step_count() const { return impl_->steps; }
void FullyShardedDataParallel::step() { impl_->step(); }
std::map<std::string, at::Tensor> FullyShardedDataParallel::gather_full_parameters() {
  return impl_->gather_full_parameters();
}
void FullyShardedDataParallel::add_state(ckpt::State& state) { impl_->add_state(state); }
void FullyShardedDataParallel::load_state(const ckpt::State& state) { impl_->load_state(state); }
int64_t FullyShardedDataParallel::optimizer_state_bytes() const {
  return impl_->optimizer_state_bytes();
}
FsdpMemory FullyShardedDataParallel::memory() const { return impl_->memory(); }
FsdpMemory FullyShardedDataParallel::peak_memory() const { return impl_->peak; }
void FullyShardedDataParallel::reset_peak_memory() { impl_->peak = impl_->memory(); }
const FsdpStats& FullyShardedDataParallel::stats() const { return impl_->stats; }
int FullyShardedDataParallel::unit_count() const { return static_cast<int>(impl_->units.size()); }

std::string FullyShardedDataParallel::unit_name(int unit) const {
  LOOM_CHECK(unit >= 0 && unit < unit_count(), InvalidArgument, "FSDP: no unit ", unit);
  return impl_->units[unit].name;
}

std::vector<std::string> FullyShardedDataParallel::unit_parameters(int unit) const {
  LOOM_CHECK(unit >= 0 && unit < unit_count(), InvalidArgument, "FSDP: no unit ", unit);
  std::vector<std::string> names;
  for (int i : impl_->units[unit].params) names.push_back(impl_->params[i].name);
  return names;
}

}  // namespace loom::parallel
