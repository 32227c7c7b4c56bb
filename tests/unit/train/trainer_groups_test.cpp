// The Trainer's traffic on Runtime's two groups. On a GPU the tensor group is NCCL, which takes
// device tensors only; here it is a Gloo group behind a decorator that stands in for that rule:
// it refuses every op that does not touch the model's parameters, gradients or buffers (what
// lives on the device), and records every op it passes. A real Trainer with evaluation,
// asynchronous checkpoints and a resume then runs at W = 2 (ranks as threads), and the test
// compares the whole list of the tensor group's ops with what DataParallel alone must issue,
// and the control group's with the Trainer's per-step scalars and the evaluation's sums.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/gloo.h"
#include "loom/comm/group.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/metrics/allocations.h"
#include "loom/parallel/data_parallel.h"
#include "loom/runtime.h"
#include "loom/train/trainer.h"

namespace loom::train {
namespace {

using comm::WorkPtr;
using parallel::ZeroStage;
constexpr int kWorld = 2;
constexpr int64_t kVocab = 32;
constexpr int64_t kDim = 8;

// One op as the decorator saw it: the name, the dtype and element count of the tensor that
// defines it (all_reduce and broadcast: the tensor; reduce_scatter: the input; all_gather: the
// output).
struct Op {
  std::string op;
  std::string dtype;
  int64_t numel = 0;
  bool operator==(const Op& o) const { return op == o.op && dtype == o.dtype && numel == o.numel; }
};
std::ostream& operator<<(std::ostream& out, const Op& op) {
  return out << op.op << " " << op.dtype << "[" << op.numel << "]";
}
std::string dtype_of(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

// The tensor group of the test: a real Gloo group that passes only ops touching device-resident
// tensors (is_device says which) and the global gradient norm (DataParallel's fp64 scalar,
// which on a GPU is a device tensor), and refuses everything else as NCCL would refuse a CPU
// tensor: InvalidArgument before anything is enqueued, so the rank fails at the offending call.
class DeviceOnlyGroup final : public comm::Group {
 public:
  DeviceOnlyGroup(std::unique_ptr<comm::Group> inner,
                  std::function<bool(const at::Tensor&)> is_device)
      : inner_(std::move(inner)), is_device_(std::move(is_device)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }

  WorkPtr all_reduce(at::Tensor& t, const comm::AllReduceOptions& o) override {
    const bool norm =
        t.scalar_type() == at::kDouble && t.numel() == 1 && o.op == comm::ReduceOp::kSum;
    admit({"all_reduce", dtype_of(t), t.numel()}, norm || is_device_(t));
    return inner_->all_reduce(t, o);
  }
  WorkPtr all_reduce_coalesced(std::vector<at::Tensor>& ts,
                               const comm::AllReduceOptions& o) override {
    admit({"all_reduce_coalesced", ts.empty() ? "" : dtype_of(ts[0]), 0}, false);
    return inner_->all_reduce_coalesced(ts, o);
  }
  WorkPtr reduce_scatter(at::Tensor& out, const at::Tensor& in,
                         const comm::ReduceScatterOptions& o) override {
    admit({"reduce_scatter", dtype_of(in), in.numel()}, is_device_(in));
    return inner_->reduce_scatter(out, in, o);
  }
  WorkPtr all_gather(at::Tensor& out, const at::Tensor& in,
                     const comm::AllGatherOptions& o) override {
    admit({"all_gather", dtype_of(out), out.numel()}, is_device_(out));
    return inner_->all_gather(out, in, o);
  }
  WorkPtr all_gather(std::vector<at::Tensor>& outs, const at::Tensor& in,
                     const comm::AllGatherOptions& o) override {
    admit({"all_gather_list", dtype_of(in), in.numel()}, false);
    return inner_->all_gather(outs, in, o);
  }
  WorkPtr broadcast(at::Tensor& t, const comm::BroadcastOptions& o) override {
    admit({"broadcast", dtype_of(t), t.numel()}, is_device_(t));
    return inner_->broadcast(t, o);
  }
  WorkPtr barrier(const comm::BarrierOptions& o) override {
    admit({"barrier", "", 0}, false);
    return inner_->barrier(o);
  }
  WorkPtr send(const at::Tensor& t, int dst, const comm::SendRecvOptions& o) override {
    admit({"send", dtype_of(t), t.numel()}, false);
    return inner_->send(t, dst, o);
  }
  WorkPtr recv(at::Tensor& t, int src, const comm::SendRecvOptions& o) override {
    admit({"recv", dtype_of(t), t.numel()}, false);
    return inner_->recv(t, src, o);
  }
  std::unique_ptr<comm::Group> new_subgroup(const std::vector<int>& ranks) override {
    admit({"new_subgroup", "", static_cast<int64_t>(ranks.size())}, false);
    return inner_->new_subgroup(ranks);
  }
  const comm::FlightRecorder& flight_recorder() const override { return inner_->flight_recorder(); }

  std::vector<Op> ops() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ops_;
  }

 private:
  void admit(const Op& op, bool allowed) {
    if (!allowed) {
      std::ostringstream what;
      what << "the tensor group got a host tensor: " << op << " (on a GPU, NCCL refuses it)";
      throw InvalidArgument(what.str());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.push_back(op);
  }

  std::unique_ptr<comm::Group> inner_;
  std::function<bool(const at::Tensor&)> is_device_;
  mutable std::mutex mutex_;
  std::vector<Op> ops_;
};

// Records the ops of the control group (a real Gloo group) without refusing any.
class RecordingGroup final : public comm::Group {
 public:
  explicit RecordingGroup(std::unique_ptr<comm::Group> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  WorkPtr all_reduce(at::Tensor& t, const comm::AllReduceOptions& o) override {
    record({"all_reduce", dtype_of(t), t.numel()}, t);
    return inner_->all_reduce(t, o);
  }
  WorkPtr all_reduce_coalesced(std::vector<at::Tensor>& ts,
                               const comm::AllReduceOptions& o) override {
    record({"all_reduce_coalesced", dtype_of(ts.at(0)), 0}, ts.at(0));
    return inner_->all_reduce_coalesced(ts, o);
  }
  WorkPtr reduce_scatter(at::Tensor& out, const at::Tensor& in,
                         const comm::ReduceScatterOptions& o) override {
    record({"reduce_scatter", dtype_of(in), in.numel()}, in);
    return inner_->reduce_scatter(out, in, o);
  }
  WorkPtr all_gather(at::Tensor& out, const at::Tensor& in,
                     const comm::AllGatherOptions& o) override {
    record({"all_gather", dtype_of(out), out.numel()}, out);
    return inner_->all_gather(out, in, o);
  }
  WorkPtr all_gather(std::vector<at::Tensor>& outs, const at::Tensor& in,
                     const comm::AllGatherOptions& o) override {
    record({"all_gather_list", dtype_of(in), in.numel()}, in);
    return inner_->all_gather(outs, in, o);
  }
  WorkPtr broadcast(at::Tensor& t, const comm::BroadcastOptions& o) override {
    record({"broadcast", dtype_of(t), t.numel()}, t);
    return inner_->broadcast(t, o);
  }
  WorkPtr barrier(const comm::BarrierOptions& o) override {
    record({"barrier", "", 0}, at::Tensor());
    return inner_->barrier(o);
  }
  WorkPtr send(const at::Tensor& t, int dst, const comm::SendRecvOptions& o) override {
    record({"send", dtype_of(t), t.numel()}, t);
    return inner_->send(t, dst, o);
  }
  WorkPtr recv(at::Tensor& t, int src, const comm::SendRecvOptions& o) override {
    record({"recv", dtype_of(t), t.numel()}, t);
    return inner_->recv(t, src, o);
  }
  std::unique_ptr<comm::Group> new_subgroup(const std::vector<int>& ranks) override {
    return inner_->new_subgroup(ranks);
  }
  const comm::FlightRecorder& flight_recorder() const override { return inner_->flight_recorder(); }
  std::vector<Op> ops() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ops_;
  }

 private:
  void record(const Op& op, const at::Tensor& t) {
    // The control group's rule: host tensors only (Gloo's too, but said here so that a
    // failure names this group).
    if (t.defined() && !t.device().is_cpu()) throw InvalidArgument("control group: device tensor");
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.push_back(op);
  }
  std::unique_ptr<comm::Group> inner_;
  mutable std::mutex mutex_;
  std::vector<Op> ops_;
};

// A small language model with a buffer (broadcast at construction, like parameters).
struct TinyLm : torch::nn::Module {
  TinyLm() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    hidden = register_module("hidden", torch::nn::Linear(kDim, kDim));
    out = register_module("out", torch::nn::Linear(kDim, kVocab));
    scale = register_buffer("scale", torch::full({kDim}, 0.5));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    return out(torch::tanh(hidden(embed(tokens)) * scale));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear hidden{nullptr}, out{nullptr};
  at::Tensor scale;
};

// Whether t shares storage with one of the model's parameters, gradients or buffers: the
// tensors that live on the device in a GPU run (DataParallel's buckets hold them all).
// A tensor of the model's state: its parameters, gradients or buffers, or a buffer that
// DataParallel allocated for them (ZeRO-2's gradient staging has no alias in the module: the
// allocation counter knows what it holds).
bool touches_model(const torch::nn::Module& model, const at::Tensor& t) {
  const auto category = metrics::category_of_allocation(t.storage().data());
  if (category == metrics::MemoryCategory::kGradients ||
      category == metrics::MemoryCategory::kParameters) {
    return true;
  }
  for (const at::Tensor& p : model.parameters()) {
    if (t.is_alias_of(p) || (p.grad().defined() && t.is_alias_of(p.grad()))) return true;
  }
  for (const at::Tensor& b : model.buffers()) {
    if (t.is_alias_of(b)) return true;
  }
  return false;
}

// What DataParallel alone puts on the tensor group.
struct Expected {
  const parallel::DataParallel& dp;
  const torch::nn::Module& model;
  ZeroStage stage;

  int64_t padded(int b) const {
    int64_t n = 0;
    for (const std::string& name : dp.bucket_parameters(b)) {
      n += model.named_parameters()[name].numel();
    }
    return (n + kWorld - 1) / kWorld * kWorld;
  }
  void construction(std::vector<Op>& ops) const {
    for (int b = 0; b < dp.bucket_count(); ++b) ops.push_back({"broadcast", "Float", padded(b)});
    ops.push_back({"broadcast", "Float", kDim});  // the buffer
  }
  void gathers(std::vector<Op>& ops) const {
    if (stage == ZeroStage::kNone) return;
    for (int b = 0; b < dp.bucket_count(); ++b) ops.push_back({"all_gather", "Float", padded(b)});
  }
  void step(std::vector<Op>& ops) const {
    for (int b = 0; b < dp.bucket_count(); ++b) {
      ops.push_back(
          {stage == ZeroStage::kTwo ? "reduce_scatter" : "all_reduce", "Float", padded(b)});
    }
    ops.push_back({"all_reduce", "Double", 1});  // the global gradient norm
    gathers(ops);
  }
};

class TrainerGroups : public ::testing::TestWithParam<ZeroStage> {
 protected:
  void SetUp() override {
    data::TokenDatasetWriter writer(dir_ / "data", {.vocab_size = kVocab});
    std::mt19937 rng(3);
    for (int d = 0; d < 40; ++d) {
      std::vector<uint32_t> doc;
      for (int i = 0; i < 40; ++i) doc.push_back(static_cast<uint32_t>(rng() % kVocab));
      writer.add_document(doc);
    }
    writer.finish();
  }
  testing::TempDir dir_;
};

// Phase 1 trains 4 steps (evaluation after step 3, an async checkpoint at step 2, the final
// one at 4); phase 2 builds a new model and DataParallel, resumes from step 4 and trains to 6.
TEST_P(TrainerGroups, ControlTrafficNeverReachesTheTensorGroup) {
  const ZeroStage stage = GetParam();
  metrics::count_cpu_allocations();  // touches_model asks it what a buffer holds
  const std::filesystem::path data_dir = dir_ / "data";
  const std::filesystem::path run_dir = dir_ / "run";
  testing::expect_all_ok(testing::run_threads(kWorld, [&](testing::Rank& r) {
    ConfigSchema keys = Runtime::schema();
    keys.merge(TrainOptions::schema());
    const Config config =
        Config::load(keys, {.read_env = false,
                            .overrides = {"run.dir=" + run_dir.string(), "run.device=cpu",
                                          "log.level=warn", "log.to_file=false"}});
    // The model of the current phase, for the decorator's rule.
    std::shared_ptr<TinyLm> model;
    auto tensor = std::make_unique<DeviceOnlyGroup>(
        comm::new_gloo_group(r.store, r.rank, r.world, {.name = "world"}),
        [&model](const at::Tensor& t) { return model != nullptr && touches_model(*model, t); });
    auto control = std::make_unique<RecordingGroup>(
        comm::new_gloo_group(r.store, r.rank, r.world, {.name = "control"}));
    DeviceOnlyGroup* tensor_ops = tensor.get();
    RecordingGroup* control_ops = control.get();
    Runtime rt = Runtime::init(
        config, Topology{r.rank, r.world, r.rank, r.world},
        /*configure_process=*/false,
        {.store = &r.store, .world_group = std::move(tensor), .control_group = std::move(control)});
    ASSERT_EQ(&rt.world_group(), tensor_ops);
    ASSERT_EQ(&rt.control_group(), control_ops);

    std::vector<Op> expected_tensor, expected_control;
    std::vector<double> losses;
    int evaluations = 0;
    auto phase = [&](int64_t steps) {
      model = std::make_shared<TinyLm>();
      parallel::DataParallel dp(model, rt.world_group(), rt.control_group(),
                                {.bucket_bytes = 512, .zero_stage = stage});
      dp.set_optimizer(std::make_unique<optim::AdamW>(optim::AdamWOptions{}));
      auto reader = rt.open_dataset(data_dir, {.batch_size = 4, .seq_len = 8, .seed = 9});
      TrainOptions options;
      options.steps = steps;
      options.micro_batches = 2;
      options.eval_every = 3;
      options.checkpoint_every = 2;
      options.log_every = 1000;
      Trainer trainer(rt, dp, *reader, options,
                      [&](const data::Batch& b) {
                        const at::Tensor tokens = b["tokens"];
                        const at::Tensor logits = model->forward(tokens.slice(1, 0, -1));
                        return MicroStep{
                            torch::cross_entropy_loss(logits.reshape({-1, kVocab}),
                                                      tokens.slice(1, 1).reshape({-1})),
                            tokens.numel(), tokens.size(0)};
                      },
                      {.on_eval =
                           [&](int64_t) {
                             // An evaluation's sums are host scalars: the control group carries
                             // them.
                             at::Tensor sums = at::tensor({1.5, 2.0}, at::kDouble);
                             rt.control_group().all_reduce(sums)->wait();
                             EXPECT_EQ(sums[0].item<double>(), 3.0);
                             ++evaluations;
                           },
                       .on_step_end = [&](const StepInfo& info) { losses.push_back(info.loss); }});
      const Expected expected{dp, *model, stage};
      expected.construction(expected_tensor);
      const FitResult result = trainer.fit();
      if (result.start_step > 0) expected.gathers(expected_tensor);  // load_state re-gathers
      for (int64_t s = result.start_step; s < result.steps_done; ++s) {
        expected.step(expected_tensor);
        // The loss, the stop flag and whether a snapshot is in flight.
        expected_control.push_back({"all_reduce", "Double", 3});
        if ((s + 1) % 3 == 0) expected_control.push_back({"all_reduce", "Double", 2});
      }
      return result;
    };

    const FitResult first = phase(4);
    EXPECT_EQ(first.start_step, 0);
    EXPECT_EQ(first.steps_done, 4);
    const FitResult second = phase(6);
    EXPECT_EQ(second.start_step, 4) << "resumed from the final checkpoint of phase 1";
    EXPECT_EQ(second.steps_done, 6);
    EXPECT_EQ(evaluations, 2);  // after steps 3 and 6
    ASSERT_EQ(losses.size(), 6u);
    for (double loss : losses) EXPECT_TRUE(std::isfinite(loss)) << loss;

    EXPECT_EQ(tensor_ops->ops(), expected_tensor);
    // The control group: per phase DataParallel's two construction checks (lengths, then the
    // signature bytes, whose count depends on the names), at phase 2's resume the Trainer's
    // exchange of the tensor names each rank loads (lengths, then bytes, the same pattern),
    // then the Trainer's and evaluation's scalars in order.
    std::vector<Op> control_seen = control_ops->ops();
    ASSERT_GE(control_seen.size(), 4u);
    std::vector<Op> checks_removed;
    int checks = 0;
    for (const Op& op : control_seen) {
      if (op.op == "all_gather") {
        EXPECT_EQ(op.dtype, checks % 2 == 0 ? "Long" : "Byte") << op;
        if (checks % 2 == 0) {
          EXPECT_EQ(op.numel, kWorld);
        }
        ++checks;
        continue;
      }
      checks_removed.push_back(op);
    }
    EXPECT_EQ(checks, 6);
    EXPECT_EQ(checks_removed, expected_control);
    model.reset();
  }));
}

INSTANTIATE_TEST_SUITE_P(Stages, TrainerGroups,
                         ::testing::Values(ZeroStage::kNone, ZeroStage::kTwo),
                         [](const ::testing::TestParamInfo<ZeroStage>& info) {
                           return std::string(parallel::to_string(info.param));
                         });

// Without attached groups a Runtime builds its control group as a second Gloo group (on CPU
// too), and the attached groups must match the topology.
TEST(RuntimeGroups, ControlGroupIsASecondGlooGroupAndAttachedGroupsMustMatch) {
  testing::TempDir dir;
  testing::expect_all_ok(testing::run_threads(kWorld, [&](testing::Rank& r) {
    const Config config = Config::load(
        Runtime::schema(), {.read_env = false,
                            .overrides = {"run.dir=" + (dir / "run").string(), "run.device=cpu",
                                          "log.level=warn", "log.to_file=false"}});
    Runtime rt = Runtime::init(config, Topology{r.rank, r.world, r.rank, r.world}, false,
                               {.store = &r.store});
    comm::Group& world = rt.world_group();
    comm::Group& control = rt.control_group();
    EXPECT_NE(&world, &control);
    EXPECT_EQ(world.name(), "world");
    EXPECT_EQ(control.name(), "control");
    at::Tensor t = at::full({3}, r.rank + 1.0);
    control.all_reduce(t)->wait();
    EXPECT_TRUE(at::equal(t, at::full({3}, 3.0)));
    EXPECT_EQ(control.flight_recorder().snapshot().size(), 1u);
    EXPECT_EQ(world.flight_recorder().snapshot().size(), 0u);

    const std::string error = testing::error_of<InvalidArgument>([&] {
      Runtime::init(config, Topology{r.rank, r.world, r.rank, r.world}, false,
                    {.store = &r.store,
                     .control_group = comm::new_gloo_group(
                         r.store, 0, 1, {.name = "solo" + std::to_string(r.rank)})});
    });
    EXPECT_TRUE(testing::contains(error, "rank 0 of 1 but the topology is rank")) << error;
  }));
}

}  // namespace
}  // namespace loom::train
