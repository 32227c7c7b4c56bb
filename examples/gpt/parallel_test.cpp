// The GPT under tensor (and sequence) parallelism, alone and under DataParallel over a dp x tp
// mesh, with ranks as threads and as processes, against the plain model trained in one process
// on the same (concatenated) batches: the same initial weights for one seed at every tp size
// (bitwise), then losses at every step, the first step's gradients and every parameter after
// the last step per element; and sizes that do not divide, named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <mutex>
#include <set>

#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/ckpt/inspect.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"
#include "loom/parallel/mesh.h"
#include "loom/parallel/pipeline.h"
#include "model.h"
#include "unit/parallel/equivalence.h"

namespace gpt {
namespace {

namespace tp = loom::parallel::tp;
using loom::parallel::DataParallel;
using loom::parallel::DeviceMesh;
using loom::parallel::Mode;
using loom::parallel::Pipeline;
using loom::parallel::Schedule;
using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_processes;
using loom::testing::run_threads;
using loom::testing::parallel::elements_beyond;
using loom::testing::parallel::expect_close_per_element;

GptConfig tiny() {
  return {.vocab_size = 64, .seq_len = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
}
constexpr int kSteps = 4;
constexpr int64_t kRowsPerReplica = 3;

// The world group of a rank of a test.
std::unique_ptr<loom::comm::Group> make_world(Rank& r) {
  loom::comm::GlooOptions options;
  options.connect_timeout = std::chrono::seconds(30);
  return loom::comm::new_gloo_group(r.store, r.rank, r.world, options);
}

// torch's global generator is shared by the rank threads: one model is built at a time.
std::mutex construction;
Gpt build(const GptParallel& parallel, const GptConfig& config = tiny()) {
  std::lock_guard<std::mutex> lock(construction);
  torch::manual_seed(2024);
  return Gpt(config, parallel);
}

// Step `step`'s batch of `replicas` x kRowsPerReplica sequences: inputs and next tokens.
std::pair<at::Tensor, at::Tensor> batch(int step, int replicas) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  const at::Tensor tokens =
      at::randint(tiny().vocab_size, {kRowsPerReplica * replicas, tiny().seq_len + 1}, gen);
  return {tokens.narrow(1, 0, tiny().seq_len), tokens.narrow(1, 1, tiny().seq_len)};
}

enum class Optimizer { kSgd, kAdamW };
constexpr double kAdamLr = 3e-3;

struct Trained {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> initial, first_gradients, final;
};

std::map<std::string, at::Tensor> copy_parameters(Gpt& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters())
    out[item.key()] = item.value().detach().clone();
  return out;
}

// The two optimizers every comparison runs, torch's.
std::unique_ptr<torch::optim::Optimizer> torch_optimizer(std::vector<at::Tensor> params,
                                                         Optimizer which) {
  if (which == Optimizer::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.5).momentum(0.9).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(kAdamLr).weight_decay(0.1));
}

// torch::optim on this rank's own parameters, on the whole batch of `replicas` replicas (the
// plain model), or on it with tensor parallelism: SGD and AdamW are elementwise, so sharded
// parameters step as the matching slices of the whole model's would.
Trained train(Gpt& model, Optimizer which, int replicas = 1) {
  auto opt = torch_optimizer(model->parameters(), which);
  Trained t;
  t.initial = copy_parameters(model);
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = batch(step, replicas);
    opt->zero_grad();
    const at::Tensor loss = model->loss(x, y);
    loss.backward();
    if (step == 0) {
      for (const auto& item : model->named_parameters())
        t.first_gradients[item.key()] = item.value().grad().clone();
    }
    opt->step();
    t.losses.push_back(loss.item<double>());
  }
  t.final = copy_parameters(model);
  return t;
}

// The same steps under DataParallel over the mesh's dp group, each replica on its rows of the
// batch (gradients averaged over the replicas; Loom's flat SGD and AdamW, which update as
// torch's do); the loss is the replicas' average.
Trained train_data_parallel(Gpt& model, Optimizer which, DeviceMesh& mesh) {
  Trained t;
  t.initial = copy_parameters(model);
  DataParallel dp(model.ptr(), mesh.group("dp"),
                  {.bucket_bytes = 16 << 10, .timeout = std::chrono::seconds(60)});
  if (which == Optimizer::kSgd) {
    dp.set_optimizer(std::make_unique<loom::optim::Sgd>(
        loom::optim::SgdOptions{.lr = 0.5, .momentum = 0.9, .weight_decay = 0.01}));
  } else {
    dp.set_optimizer(std::make_unique<loom::optim::AdamW>(
        loom::optim::AdamWOptions{.lr = kAdamLr, .weight_decay = 0.1}));
  }
  const int replicas = mesh.size("dp"), replica = mesh.coordinate("dp");
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = batch(step, replicas);
    dp.zero_grad();
    const at::Tensor loss = model->loss(x.narrow(0, kRowsPerReplica * replica, kRowsPerReplica),
                                        y.narrow(0, kRowsPerReplica * replica, kRowsPerReplica));
    loss.backward();
    dp.finish_gradient_sync();
    if (step == 0) {
      for (const auto& item : model->named_parameters())
        t.first_gradients[item.key()] = item.value().grad().clone();
    }
    dp.step();
    at::Tensor average = loss.detach().clone();
    mesh.group("dp").all_reduce(average, {.op = loom::comm::ReduceOp::kAvg})->wait();
    t.losses.push_back(average.item<double>());
  }
  t.final = copy_parameters(model);
  return t;
}

// This rank's piece of each of the plain model's tensors.
std::map<std::string, at::Tensor> shards_of(const std::map<std::string, at::Tensor>& plain,
                                            Gpt& model, loom::comm::Group* group) {
  std::map<std::string, at::Tensor> out;
  for (const tp::ShardedParameter& p : tp::sharded_parameters(*model)) {
    out[p.name] = p.spec.replicated()
                      ? plain.at(p.name)
                      : tp::shard(plain.at(p.name), p.spec.dim, group, p.spec.partitions);
  }
  return out;
}

// AdamW divides each element's gradient by its own running magnitude, so an element whose
// gradient is small next to its tensor's, where the fp32 terms of its sum cancel, gets a step
// whose relative difference is that of the cancelling sum (the gradients themselves agree
// within 1e-5 of the tensor's rms). After AdamW steps every element is checked within 1e-4 and
// all but 0.1% of the model's elements within 1e-5; SGD's step is linear in the gradient and
// every element is within 1e-5. The key bias gets no gradient in exact arithmetic (softmax
// over keys is invariant to adding q . b to every score of a query): its fp32 gradient is
// rounding noise and AdamW turns noise into steps, so under AdamW its elements are checked to
// stay noise-sized (within steps x lr of zero) and the query and value biases per element.
bool is_qkv_bias(const std::string& name) {
  return name.size() >= 13 && name.compare(name.size() - 13, 13, "attn.qkv.bias") == 0;
}

// `actual` holds the parameters to compare (a pipeline stage's; every one otherwise).
// adam_rtol: the bound every element keeps after AdamW steps (all but 0.1% keep 1e-5).
void expect_trains_like(const Trained& expected, const Trained& actual, Gpt& model,
                        loom::comm::Group* group, Optimizer which, const std::string& what,
                        double adam_rtol = 1e-4) {
  // The initial weights: this rank's shard of the plain model's, bitwise.
  const auto initial = shards_of(expected.initial, model, group);
  for (const auto& [name, tensor] : actual.initial) {
    EXPECT_TRUE(tensor.equal(initial.at(name))) << what << ": initial " << name;
  }
  // fp32 sums in other orders (the row-parallel matmuls summed over ranks, the log-sum-exp
  // over vocabulary shards, the gradients averaged over replicas), per element.
  expect_close_per_element(torch::tensor(actual.losses, torch::kDouble),
                           torch::tensor(expected.losses, torch::kDouble), what + ": losses");
  EXPECT_GT(std::abs(actual.losses.front() - actual.losses.back()), 1e-3) << what;
  const auto gradients = shards_of(expected.first_gradients, model, group);
  for (const auto& [name, tensor] : actual.first_gradients) {
    expect_close_per_element(tensor, gradients.at(name), what + ": first gradient of " + name);
  }
  const auto final = shards_of(expected.final, model, group);
  int64_t beyond = 0, total = 0;  // AdamW: elements beyond 1e-5, of all checked
  for (const auto& [name, tensor] : actual.final) {
    if (which == Optimizer::kSgd) {
      expect_close_per_element(tensor, final.at(name), what + ": " + name);
      continue;
    }
    if (is_qkv_bias(name)) {  // [q; k; v] of this rank's heads: q and v per element, k noise
      const auto got = tensor.chunk(3), want = final.at(name).chunk(3);
      expect_close_per_element(got[0], want[0], what + ": " + name + " (queries)", adam_rtol);
      expect_close_per_element(got[2], want[2], what + ": " + name + " (values)", adam_rtol);
      EXPECT_LE(got[1].abs().max().item<double>(), kSteps * kAdamLr) << what << ": " << name;
      EXPECT_LE(want[1].abs().max().item<double>(), kSteps * kAdamLr) << what << ": " << name;
      continue;
    }
    expect_close_per_element(tensor, final.at(name), what + ": " + name, adam_rtol);
    beyond += elements_beyond(tensor, final.at(name), 1e-5);
    total += tensor.numel();
  }
  EXPECT_LE(beyond, total / 1000) << what << ": elements beyond 1e-5, of " << total;
}

struct Layout {
  int tp;
  bool sequence_parallel = false;
  int dp = 1;  // > 1: DataParallel over the dp dimension of a dp x tp mesh
};

std::string name_of(const Layout& l) {
  return (l.dp > 1 ? "dp" + std::to_string(l.dp) + "_" : "") + "tp" + std::to_string(l.tp) +
         (l.sequence_parallel ? "_sp" : "");
}

// The plain model's training on the whole batch, under each optimizer.
std::map<Optimizer, Trained> plain_training(int replicas) {
  std::map<Optimizer, Trained> out;
  for (const Optimizer which : {Optimizer::kSgd, Optimizer::kAdamW}) {
    Gpt plain = build({});
    out[which] = train(plain, which, replicas);
  }
  return out;
}

// One rank's part: the mesh, the model under each optimizer, the comparison.
void check_rank(Rank& r, const Layout& layout, const std::map<Optimizer, Trained>& expected) {
  auto world = make_world(r);
  DeviceMesh mesh(*world, {{"dp", layout.dp}, {"tp", layout.tp}});
  for (const auto& [which, reference] : expected) {
    Gpt model = build({.tp = &mesh.group("tp"), .sequence_parallel = layout.sequence_parallel});
    const Trained actual =
        layout.dp > 1 ? train_data_parallel(model, which, mesh) : train(model, which);
    expect_trains_like(
        reference, actual, model, &mesh.group("tp"), which,
        std::string(which == Optimizer::kSgd ? "SGD, " : "AdamW, ") + name_of(layout));
  }
}

class GptTensorParallel : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }  // process-wide: ranks are threads
};

TEST_P(GptTensorParallel, TrainsLikeThePlainModelInOneProcess) {
  const Layout layout = GetParam();
  const auto expected = plain_training(layout.dp);
  expect_all_ok(
      run_threads(layout.tp * layout.dp, [&](Rank& r) { check_rank(r, layout, expected); }));
}

INSTANTIATE_TEST_SUITE_P(Threads, GptTensorParallel,
                         ::testing::Values(Layout{1}, Layout{2}, Layout{4}, Layout{2, true},
                                           Layout{4, true}, Layout{2, false, 2},
                                           Layout{2, true, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return name_of(info.param);
                         });

// Real processes over a FileStore; each computes the plain reference itself.
class GptTensorParallelProcesses : public ::testing::TestWithParam<Layout> {};

TEST_P(GptTensorParallelProcesses, TrainsLikeThePlainModelInOneProcess) {
  const Layout layout = GetParam();
  expect_all_ok(run_processes(layout.tp * layout.dp, [&](Rank& r) {
    torch::set_num_threads(1);
    check_rank(r, layout, plain_training(layout.dp));
  }));
}

INSTANTIATE_TEST_SUITE_P(Processes, GptTensorParallelProcesses,
                         ::testing::Values(Layout{1}, Layout{2}, Layout{4}, Layout{4, true},
                                           Layout{2, false, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return name_of(info.param);
                         });

// ---- Pipeline parallelism ----

// Eight blocks, so that 2 and 4 stages of 1 or 2 chunks each divide them.
GptConfig deep() {
  GptConfig c = tiny();
  c.n_layer = 8;
  return c;
}
constexpr int kMicroBatches = 4;
constexpr int kPipelineRows = 8;  // per step: 4 micro-batches of 2 sequences

struct PipelineLayout {
  int pp;
  Schedule schedule;
  int chunks = 1;
};

std::string name_of(const PipelineLayout& l) {
  std::string s = loom::parallel::to_string(l.schedule);
  for (char& ch : s) {
    if (ch == '-') ch = '_';
  }
  return "pp" + std::to_string(l.pp) + "_" + s +
         (l.chunks > 1 ? "_v" + std::to_string(l.chunks) : "");
}

// Step `step`'s batch for `replicas` pipelines of kPipelineRows sequences each.
std::pair<at::Tensor, at::Tensor> pipeline_batch(int step, int replicas) {
  const int64_t rows = kPipelineRows * replicas;
  const auto [x, y] = batch(step, static_cast<int>(rows / kRowsPerReplica + 1));
  return {x.narrow(0, 0, rows), y.narrow(0, 0, rows)};
}

// The plain model on the pipelines' batches: the whole batch in one backward, or (accumulate)
// as the stages compute it: each replica's 4 micro-batches' backwards accumulated, and the
// replicas' gradients averaged.
Trained train_plain_deep(Optimizer which, bool accumulate, int replicas = 1) {
  Gpt model = build({}, deep());
  auto opt = torch_optimizer(model->parameters(), which);
  std::vector<at::Tensor> params = model->parameters();
  Trained t;
  t.initial = copy_parameters(model);
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = pipeline_batch(step, replicas);
    double loss = 0;
    if (!accumulate) {
      opt->zero_grad();
      const at::Tensor whole = model->loss(x, y);
      whole.backward();
      loss = whole.item<double>();
    } else {
      std::vector<at::Tensor> sums(params.size());
      const int64_t rows = kPipelineRows / kMicroBatches;
      for (int replica = 0; replica < replicas; ++replica) {
        opt->zero_grad();
        for (int i = 0; i < kMicroBatches; ++i) {
          const int64_t first = kPipelineRows * replica + rows * i;
          const at::Tensor piece =
              model->loss(x.narrow(0, first, rows), y.narrow(0, first, rows)) / kMicroBatches;
          piece.backward();
          loss += piece.item<double>() / replicas;
        }
        for (size_t k = 0; k < params.size(); ++k) {
          sums[k] = replica == 0 ? params[k].grad().clone() : sums[k] + params[k].grad();
        }
      }
      for (size_t k = 0; k < params.size(); ++k) params[k].mutable_grad() = sums[k] / replicas;
    }
    if (step == 0) {
      for (const auto& item : model->named_parameters())
        t.first_gradients[item.key()] = item.value().grad().clone();
    }
    opt->step();
    t.losses.push_back(loss);
  }
  t.final = copy_parameters(model);
  return t;
}

// One pipeline rank: its chunks of the model (every rank builds the whole model from the
// seed), the schedule over 4 micro-batches, the tied embedding's gradient summed between the
// first and the last stage, torch::optim on the stage's parameters. With `dp`, each replica's
// pipeline runs on its rows of the batch and the stages' gradients are averaged over dp.
Trained train_pipeline(Gpt& model, loom::comm::Group& pp, const PipelineLayout& l, Optimizer which,
                       loom::comm::Group* dp = nullptr) {
  const int replicas = dp == nullptr ? 1 : dp->size(), replica = dp == nullptr ? 0 : dp->rank();
  const int p = pp.size(), s = pp.rank(), n = p * l.chunks;
  std::vector<loom::parallel::StageFn> chunks;
  std::vector<at::Tensor> params;
  std::set<const void*> seen;
  for (int j = 0; j < l.chunks; ++j) {
    const auto [begin, end] = GptImpl::stage_layers(deep(), j * p + s, n);
    chunks.push_back([&model, begin = begin, end = end](const at::Tensor& in) {
      return model->forward_stage(in, begin, end);
    });
    for (const at::Tensor& t : model->stage_parameters(begin, end)) {
      if (seen.insert(t.data_ptr()).second) params.push_back(t);
    }
  }
  Pipeline pipe(pp, std::move(chunks),
                {.schedule = l.schedule,
                 .micro_batches = kMicroBatches,
                 .timeout = std::chrono::seconds(60)});
  std::unique_ptr<loom::comm::Group> tied;  // the first and the last stage's ranks
  if (p > 1 && (s == 0 || s == p - 1)) tied = pp.new_subgroup({0, p - 1});
  auto opt = torch_optimizer(params, which);
  Trained t;
  for (const auto& item : model->named_parameters()) {
    if (seen.count(item.value().data_ptr()) != 0)
      t.initial[item.key()] = item.value().detach().clone();
  }
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = pipeline_batch(step, replicas);
    opt->zero_grad();
    double loss = pipe.step(x.narrow(0, kPipelineRows * replica, kPipelineRows),
                            y.narrow(0, kPipelineRows * replica, kPipelineRows),
                            [&](const at::Tensor& logits, const at::Tensor& targets) {
                              return model->loss_from_logits(logits, targets);
                            });
    if (tied != nullptr) {
      at::Tensor& grad = model->wte->weight.mutable_grad();
      tied->all_reduce(grad)->wait(std::chrono::seconds(60));
    }
    if (replicas > 1) {
      for (at::Tensor& param : params) {
        dp->all_reduce(param.mutable_grad(), {.op = loom::comm::ReduceOp::kAvg})
            ->wait(std::chrono::seconds(60));
      }
      at::Tensor average = torch::full({1}, loss, torch::kDouble);
      dp->all_reduce(average, {.op = loom::comm::ReduceOp::kAvg})->wait(std::chrono::seconds(60));
      loss = average.item<double>();
    }
    if (step == 0) {
      for (const auto& [name, tensor] : t.initial)
        t.first_gradients[name] = model->named_parameters()[name].grad().clone();
    }
    opt->step();
    t.losses.push_back(loss);
  }
  for (const auto& [name, tensor] : t.initial)
    t.final[name] = model->named_parameters()[name].detach().clone();
  return t;
}

class GptPipeline : public ::testing::TestWithParam<PipelineLayout> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }  // process-wide: ranks are threads
};

// Against the plain model on the whole batch under SGD; under AdamW, whose per-element
// normalisation magnifies the different summation of 4 accumulated micro-batches (see above),
// against the plain model accumulating the same micro-batches.
std::map<Optimizer, Trained> pipeline_reference() {
  return {{Optimizer::kSgd, train_plain_deep(Optimizer::kSgd, /*accumulate=*/false)},
          {Optimizer::kAdamW, train_plain_deep(Optimizer::kAdamW, /*accumulate=*/true)}};
}

void check_pipeline_rank(Rank& r, const PipelineLayout& layout,
                         const std::map<Optimizer, Trained>& expected) {
  auto world = make_world(r);
  DeviceMesh mesh(*world, {{"pp", layout.pp}});
  for (const auto& [which, reference] : expected) {
    Gpt model = build({}, deep());
    const Trained actual = train_pipeline(model, mesh.group("pp"), layout, which);
    expect_trains_like(reference, actual, model, nullptr, which,
                       std::string(which == Optimizer::kSgd ? "SGD, " : "AdamW, ") +
                           name_of(layout) + " rank " + std::to_string(r.rank));
  }
}

TEST_P(GptPipeline, TrainsLikeThePlainModelInOneProcess) {
  const PipelineLayout layout = GetParam();
  const auto expected = pipeline_reference();
  expect_all_ok(run_threads(layout.pp, [&](Rank& r) { check_pipeline_rank(r, layout, expected); }));
}

const auto kPipelineLayouts =
    ::testing::Values(PipelineLayout{2, Schedule::kGPipe}, PipelineLayout{4, Schedule::kGPipe},
                      PipelineLayout{2, Schedule::k1F1B}, PipelineLayout{4, Schedule::k1F1B},
                      PipelineLayout{2, Schedule::kInterleaved1F1B, 2},
                      PipelineLayout{4, Schedule::kInterleaved1F1B, 2});

INSTANTIATE_TEST_SUITE_P(Threads, GptPipeline, kPipelineLayouts,
                         [](const ::testing::TestParamInfo<PipelineLayout>& info) {
                           return name_of(info.param);
                         });

// The same as real processes over a FileStore, each computing the plain reference itself.
class GptPipelineProcesses : public ::testing::TestWithParam<PipelineLayout> {};

TEST_P(GptPipelineProcesses, TrainsLikeThePlainModelInOneProcess) {
  const PipelineLayout layout = GetParam();
  expect_all_ok(run_processes(layout.pp, [&](Rank& r) {
    torch::set_num_threads(1);
    check_pipeline_rank(r, layout, pipeline_reference());
  }));
}

INSTANTIATE_TEST_SUITE_P(Processes, GptPipelineProcesses, kPipelineLayouts,
                         [](const ::testing::TestParamInfo<PipelineLayout>& info) {
                           return name_of(info.param);
                         });

// pp x dp x tp through one mesh: 1F1B over pp, the GPT's tensor (and sequence) parallelism
// over tp inside every stage, gradients averaged over dp, against the plain model on the
// replicas' whole batch (SGD) and computing as the stages do (AdamW: each replica's micro-batches
// accumulated, the replicas averaged).
// Three reorderings compound here (row-parallel sums, micro-batch accumulation, the replicas'
// average), and AdamW's normalisation magnifies them on the elements whose gradient nearly
// cancels: measured, one element of 2048 in each of three tensors is beyond 1e-4 x (|p| + rms)
// after 4 steps (the worst 6.7e-6 absolute), the rest as elsewhere. SGD's parameters and every
// loss and first gradient keep 1e-5.
constexpr double kComposedAdamRtol = 1e-3;

struct ComposedLayout {
  int pp, dp, tp;
  bool sequence_parallel = false;
};

void check_composed_rank(Rank& r, const ComposedLayout& l,
                         const std::map<Optimizer, Trained>& expected) {
  auto world = make_world(r);
  DeviceMesh mesh(*world, {{"pp", l.pp}, {"dp", l.dp}, {"tp", l.tp}});
  for (const auto& [which, reference] : expected) {
    Gpt model = build({.tp = &mesh.group("tp"), .sequence_parallel = l.sequence_parallel}, deep());
    const Trained actual =
        train_pipeline(model, mesh.group("pp"), {l.pp, Schedule::k1F1B}, which, &mesh.group("dp"));
    expect_trains_like(reference, actual, model, &mesh.group("tp"), which,
                       std::string(which == Optimizer::kSgd ? "SGD, " : "AdamW, ") + "pp" +
                           std::to_string(l.pp) + " x dp" + std::to_string(l.dp) + " x tp" +
                           std::to_string(l.tp) + (l.sequence_parallel ? " sp" : "") + " rank " +
                           std::to_string(r.rank),
                       kComposedAdamRtol);
  }
}

std::map<Optimizer, Trained> composed_reference(int replicas) {
  return {{Optimizer::kSgd, train_plain_deep(Optimizer::kSgd, /*accumulate=*/false, replicas)},
          {Optimizer::kAdamW, train_plain_deep(Optimizer::kAdamW, /*accumulate=*/true, replicas)}};
}

TEST(GptComposed, PipelineDataAndTensorParallelTwoByTwoByTwoTrainLikeThePlainModel) {
  torch::set_num_threads(1);
  for (const bool sp : {false, true}) {
    const ComposedLayout layout{2, 2, 2, sp};
    const auto expected = composed_reference(layout.dp);
    expect_all_ok(run_threads(8, [&](Rank& r) { check_composed_rank(r, layout, expected); }));
  }
}

TEST(GptComposed, PipelineDataAndTensorParallelTwoByTwoByTwoAsProcesses) {
  const ComposedLayout layout{2, 2, 2};
  expect_all_ok(run_processes(8, [&](Rank& r) {
    torch::set_num_threads(1);
    check_composed_rank(r, layout, composed_reference(layout.dp));
  }));
}

// --- pp x dp x tp with Loom's data-parallel strategies as dp ---------------------------------
//
// Each rank keeps its stage's parameters only (keep_layers), under the whole model's names, and
// a DataParallel (ddp, zero2) or an FSDP (every block a unit) over the dp group shards them,
// with parallel::ModelParallel saying how they are pieces of the whole model: the pipeline runs
// its micro-batches under no_sync, reduce_accumulated_gradients sums the tied embedding between
// the first and the last stage and reduces over dp, clip_grad_norm gives the whole model's norm.

struct Staged {
  std::unique_ptr<loom::comm::Group> tied;  // the first and the last stage's ranks
  std::unique_ptr<loom::parallel::Strategy> strategy;
  std::unique_ptr<Pipeline> pipe;
};

std::unique_ptr<loom::optim::FlatOptimizer> loom_optimizer(Optimizer which) {
  if (which == Optimizer::kSgd) {
    return std::make_unique<loom::optim::Sgd>(
        loom::optim::SgdOptions{.lr = 0.5, .momentum = 0.9, .weight_decay = 0.01});
  }
  return std::make_unique<loom::optim::AdamW>(
      loom::optim::AdamWOptions{.lr = kAdamLr, .weight_decay = 0.1});
}

// `model` cut to this rank's stage of a 1F1B pipeline over the mesh's pp group, with `mode` over
// its dp group.
Staged stage_under(Gpt& model, DeviceMesh& mesh, Mode mode) {
  Staged st;
  loom::comm::Group& pp = mesh.group("pp");
  const auto [begin, end] = GptImpl::stage_layers(deep(), pp.rank(), pp.size());
  loom::parallel::ModelParallel mp{.tp = &mesh.group("tp"), .pp = &pp};
  const std::vector<std::string> tied = model->keep_layers({{begin, end}});
  if (!tied.empty()) {
    st.tied = pp.new_subgroup({0, pp.size() - 1});
    for (const std::string& name : tied) mp.tied.push_back({name, st.tied.get()});
  }
  const auto timeout = std::chrono::milliseconds(std::chrono::seconds(60));
  if (mode == Mode::kFsdp) {
    loom::parallel::wrap_modules<BlockImpl>(model->blocks);
    st.strategy = std::make_unique<loom::parallel::FullyShardedDataParallel>(
        model.ptr(), mesh.group("dp"),
        loom::parallel::FsdpOptions{.timeout = timeout, .model_parallel = mp});
  } else {
    st.strategy = std::make_unique<DataParallel>(
        model.ptr(), mesh.group("dp"),
        loom::parallel::DataParallelOptions{.bucket_bytes = 16 << 10,
                                            .zero_stage = mode == Mode::kZero2
                                                              ? loom::parallel::ZeroStage::kTwo
                                                              : loom::parallel::ZeroStage::kNone,
                                            .timeout = timeout,
                                            .model_parallel = mp});
  }
  st.pipe = std::make_unique<Pipeline>(
      pp,
      std::vector<loom::parallel::StageFn>{
          [&model, begin = begin, end = end](const at::Tensor& in) {
            return model->forward_stage(in, begin, end);
          }},
      loom::parallel::PipelineOptions{.micro_batches = kMicroBatches, .timeout = timeout});
  return st;
}

// This rank's parameters as the strategy holds them now (FSDP's gathered).
std::map<std::string, at::Tensor> strategy_parameters(Gpt& model, loom::parallel::Strategy& s) {
  if (auto* fsdp = dynamic_cast<loom::parallel::FullyShardedDataParallel*>(&s))
    return fsdp->gather_full_parameters();
  return copy_parameters(model);
}

// One training step of a staged rank on its replica's rows; returns the replicas' mean loss and
// the whole model's gradient norm.
std::pair<double, double> staged_step(Gpt& model, Staged& st, DeviceMesh& mesh, int step) {
  const int replicas = mesh.size("dp"), replica = mesh.coordinate("dp");
  const auto [x, y] = pipeline_batch(step, replicas);
  loom::parallel::Strategy& strategy = *st.strategy;
  strategy.zero_grad();
  strategy.set_sync(false);
  double loss = st.pipe->step(x.narrow(0, kPipelineRows * replica, kPipelineRows),
                              y.narrow(0, kPipelineRows * replica, kPipelineRows),
                              [&](const at::Tensor& logits, const at::Tensor& targets) {
                                return model->loss_from_logits(logits, targets);
                              });
  strategy.reduce_accumulated_gradients();
  strategy.finish_gradient_sync();
  const double norm = strategy.clip_grad_norm(std::numeric_limits<double>::infinity());
  strategy.step();
  at::Tensor average = torch::full({1}, loss, torch::kDouble);
  mesh.group("dp").all_reduce(average, {.op = loom::comm::ReduceOp::kAvg})->wait();
  return {average.item<double>(), norm};
}

// The 2-norm of every first gradient of the plain model.
double norm_of(const std::map<std::string, at::Tensor>& gradients) {
  double squares = 0;
  for (const auto& [name, g] : gradients)
    squares += g.to(torch::kDouble).square().sum().item<double>();
  return std::sqrt(squares);
}

std::string name_of(Mode mode) { return loom::parallel::to_string(mode); }

void check_staged_rank(Rank& r, Mode mode, const std::map<Optimizer, Trained>& expected) {
  auto world = make_world(r);
  DeviceMesh mesh(*world, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
  for (const auto& [which, reference] : expected) {
    const std::string what = std::string(which == Optimizer::kSgd ? "SGD, " : "AdamW, ") +
                             "pp2 x " + name_of(mode) + "2 x tp2 rank " + std::to_string(r.rank);
    Gpt model = build({.tp = &mesh.group("tp")}, deep());
    Trained actual;
    Staged st;
    actual.initial = copy_parameters(model);  // before keep_layers: the whole model's shards
    st = stage_under(model, mesh, mode);
    for (auto it = actual.initial.begin(); it != actual.initial.end();) {  // this stage's only
      it = model->named_parameters().contains(it->first) ? std::next(it) : actual.initial.erase(it);
    }
    st.strategy->set_optimizer(loom_optimizer(which));
    for (int step = 0; step < kSteps; ++step) {
      const auto [loss, norm] = staged_step(model, st, mesh, step);
      actual.losses.push_back(loss);
      if (step == 0) {  // the whole model's norm: tp-sharded summed, replicated and tied once
        expect_close_per_element(
            torch::tensor({norm}, torch::kDouble),
            torch::tensor({norm_of(reference.first_gradients)}, torch::kDouble),
            what + ": the first step's gradient norm");
      }
    }
    actual.final = strategy_parameters(model, *st.strategy);
    expect_trains_like(reference, actual, model, &mesh.group("tp"), which, what, kComposedAdamRtol);
  }
}

class GptStaged : public ::testing::TestWithParam<Mode> {};

TEST_P(GptStaged, PipelineOverStrategiesTrainsLikeThePlainModel) {
  torch::set_num_threads(1);
  const auto expected = composed_reference(2);
  expect_all_ok(run_threads(8, [&](Rank& r) { check_staged_rank(r, GetParam(), expected); }));
}

INSTANTIATE_TEST_SUITE_P(Threads, GptStaged,
                         ::testing::Values(Mode::kDdp, Mode::kZero2, Mode::kFsdp),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return name_of(info.param);
                         });

TEST(GptStagedProcesses, PipelineOverFsdpTrainsLikeThePlainModel) {
  expect_all_ok(run_processes(8, [&](Rank& r) {
    torch::set_num_threads(1);
    check_staged_rank(r, Mode::kFsdp, composed_reference(2));
  }));
}

// A checkpoint of the whole training state saved at pp 2 x dp 2 x tp 2 (FSDP as dp, after 2
// AdamW steps) loads at pp 1 x dp 2 x tp 1 (ZeRO-2) and at tp 4 (DDP), and saved again from
// there, every tensor of both checkpoints read whole is bitwise the same; the parameters each
// rank loaded are its shards of the saved ones, bitwise.
std::map<std::string, at::Tensor> read_whole(const std::filesystem::path& dir) {
  loom::comm::InMemoryStore store;
  loom::ckpt::Checkpointer ckpt(store, {.dir = dir});
  loom::ckpt::State whole;
  for (const auto& t : loom::ckpt::describe_step(dir, 1).tensors) {
    EXPECT_EQ(t.dtype, "float32") << t.name;
    whole.add(t.name, torch::zeros(t.shape, torch::kFloat32));
  }
  ckpt.load(1, whole, {.leave_out = {"optim"}});
  std::map<std::string, at::Tensor> out;
  for (const auto& e : whole.tensors) out[e.name] = e.tensor;
  return out;
}

struct Grid {
  int pp, dp, tp;
  Mode mode;
};

// Builds `grid`'s rank, saves (after `steps` AdamW steps) or loads its state at step 1 of `dir`.
void save_or_load(Rank& r, const Grid& g, const std::filesystem::path& dir, bool save,
                  const std::filesystem::path& save_again = {}) {
  auto world = make_world(r);
  DeviceMesh mesh(*world, {{"pp", g.pp}, {"dp", g.dp}, {"tp", g.tp}});
  Gpt model = build({.tp = &mesh.group("tp")}, deep());
  Staged st = stage_under(model, mesh, g.mode);
  st.strategy->set_optimizer(loom_optimizer(Optimizer::kAdamW));
  if (save) {
    for (int step = 0; step < 2; ++step) staged_step(model, st, mesh, step);
  }
  loom::ckpt::Checkpointer ckpt(r.store, {.dir = dir, .rank = r.rank, .world_size = r.world});
  loom::ckpt::State state;
  st.strategy->add_state(state);
  if (save) {
    ckpt.save_sync(1, state);
    return;
  }
  ckpt.load(1, state);
  st.strategy->load_state(state);
  loom::ckpt::Checkpointer again(r.store,
                                 {.dir = save_again, .rank = r.rank, .world_size = r.world});
  loom::ckpt::State out;
  st.strategy->add_state(out);
  again.save_sync(1, out);
}
TEST(GptStagedCheckpoint, SavedAtPp2Dp2Tp2LoadsAtDp2AndAtTp4Bitwise) {
  torch::set_num_threads(1);
  loom::testing::TempDir dir;
  expect_all_ok(run_threads(8, [&](Rank& r) {
    save_or_load(r, {2, 2, 2, Mode::kFsdp}, dir / "saved", /*save=*/true);
  }));
  const auto saved = read_whole(dir / "saved");
  // Every parameter, its exp_avg and its exp_avg_sq (fp32: no master copy).
  EXPECT_EQ(saved.size(), 3 * tp::sharded_parameters(*build({}, deep())).size());
  const std::vector<std::pair<Grid, std::string>> grids = {{{1, 2, 1, Mode::kZero2}, "dp2"},
                                                           {{1, 1, 4, Mode::kDdp}, "tp4"}};
  for (const auto& [grid, name] : grids) {
    SCOPED_TRACE(name);
    expect_all_ok(run_threads(grid.pp * grid.dp * grid.tp, [&](Rank& r) {
      save_or_load(r, grid, dir / "saved", /*save=*/false, dir / name);
    }));
    const auto again = read_whole(dir / name);
    ASSERT_EQ(again.size(), saved.size());
    for (const auto& [tensor, value] : saved) {
      ASSERT_EQ(again.count(tensor), 1u) << tensor;
      EXPECT_TRUE(again.at(tensor).equal(value)) << tensor;
    }
  }
}

// The whole model's gradient norm under pp x tp (tp::grad_norm, clip_grad_norm): equal to
// torch's clip_grad_norm_ of the plain model on the same batch, and the clipped gradients too.
TEST(GptModelParallelNorm, ClippingUsesTheWholeModelsNorm) {
  torch::set_num_threads(1);
  const auto [x, y] = pipeline_batch(0, 1);
  Gpt plain = build({}, deep());
  plain->loss(x, y).backward();
  std::vector<at::Tensor> plain_params = plain->parameters();
  const double expected =
      torch::nn::utils::clip_grad_norm_(plain_params, std::numeric_limits<double>::infinity());
  const double max_norm = expected / 4;  // clips
  std::map<std::string, at::Tensor> clipped;
  {
    torch::nn::utils::clip_grad_norm_(plain_params, max_norm);
    for (const auto& item : plain->named_parameters())
      clipped[item.key()] = item.value().grad().clone();
  }
  for (const int pp : {1, 2}) {
    for (const int tp : {1, 2, 4}) {
      if (pp * tp == 1) continue;
      expect_all_ok(run_threads(pp * tp, [&](Rank& r) {
        auto world = make_world(r);
        DeviceMesh mesh(*world, {{"pp", pp}, {"tp", tp}});
        Gpt model = build({.tp = &mesh.group("tp")}, deep());
        const int s = mesh.coordinate("pp");
        const auto [begin, end] = GptImpl::stage_layers(deep(), s, pp);
        std::set<const void*> mine;
        for (const at::Tensor& t : model->stage_parameters(begin, end)) mine.insert(t.data_ptr());
        if (pp > 1 && s == pp - 1) mine.erase(model->wte->weight.data_ptr());  // on stage 0
        std::vector<tp::ShardedParameter> params;
        for (const tp::ShardedParameter& p : tp::sharded_parameters(*model)) {
          if (mine.count(p.tensor.data_ptr()) != 0) params.push_back(p);
        }
        Pipeline pipe(mesh.group("pp"), {[&model, begin = begin, end = end](const at::Tensor& in) {
                        return model->forward_stage(in, begin, end);
                      }},
                      {.micro_batches = kMicroBatches, .timeout = std::chrono::seconds(60)});
        pipe.step(x, y, [&](const at::Tensor& logits, const at::Tensor& targets) {
          return model->loss_from_logits(logits, targets);
        });
        if (pp > 1 && (s == 0 || s == pp - 1)) {
          auto tied = mesh.group("pp").new_subgroup({0, pp - 1});
          tied->all_reduce(model->wte->weight.mutable_grad())->wait(std::chrono::seconds(60));
        }
        const std::string what = "pp" + std::to_string(pp) + " x tp" + std::to_string(tp);
        const double norm =
            tp::clip_grad_norm(params, max_norm, &mesh.group("tp"), &mesh.group("pp"));
        expect_close_per_element(torch::tensor({norm}, torch::kDouble),
                                 torch::tensor({expected}, torch::kDouble), what + ": norm");
        for (const tp::ShardedParameter& p : params) {
          const at::Tensor want =
              p.spec.replicated()
                  ? clipped.at(p.name)
                  : tp::shard(clipped.at(p.name), p.spec.dim, &mesh.group("tp"), p.spec.partitions);
          expect_close_per_element(p.tensor.grad(), want, what + ": clipped " + p.name);
        }
      }));
    }
  }
}

TEST(GptPipelineErrors, LayersThatDoNotDivideIntoStagesAreNamed) {
  EXPECT_THAT([] { GptImpl::stage_layers(deep(), 0, 3); },
              ::testing::ThrowsMessage<loom::ConfigError>(
                  "model.n_layer (8) does not divide into 3 pipeline stages; choose a layer "
                  "count that is a multiple of the stages"));
}

TEST(GptTensorParallelErrors, HeadsAndVocabularyThatDoNotDivideAreNamed) {
  expect_all_ok(run_threads(4, [](Rank& r) {
    auto group = make_world(r);
    GptConfig heads = tiny();
    heads.n_head = 2;
    heads.n_embd = 32;
    EXPECT_THAT([&] { Gpt(heads, GptParallel{.tp = group.get()}); },
                ::testing::ThrowsMessage<loom::ConfigError>(
                    "model.n_head (2) must be a multiple of parallel.tp (4): each "
                    "tensor-parallel rank computes whole heads"));
    GptConfig vocab = tiny();
    vocab.vocab_size = 66;
    EXPECT_THAT([&] { Gpt(vocab, GptParallel{.tp = group.get()}); },
                ::testing::ThrowsMessage<loom::ConfigError>(
                    "the vocabulary size (66) must be a multiple of parallel.tp (4): each "
                    "tensor-parallel rank holds an equal share of the embedding"));
  }));
}

}  // namespace
}  // namespace gpt
