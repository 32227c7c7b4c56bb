// Pipeline parallelism: a model cut into stages on the ranks of a pipeline group, a batch cut
// into micro-batches, and a schedule that orders each rank's forwards and backwards.
//
//   loom::parallel::Pipeline pipe(mesh.group("pp"), {[&](const at::Tensor& x) {
//                                   return model->forward_layers(x, begin, end, first, last);
//                                 }},
//                                 {.schedule = loom::parallel::Schedule::k1F1B, .micro_batches =
//                                 8});
//   double loss = pipe.step(ids, targets, [&](const at::Tensor& logits, const at::Tensor& y) {
//     return cross_entropy(logits, y);
//   });  // gradients accumulated in the stages' parameters; the same loss on every rank
//
// Stage s (of p) runs on pipeline rank s; with v chunks per rank (interleaved 1F1B) chunk j of
// rank s is virtual stage j * p + s. Activations go forward and their gradients backward by
// send/recv with a deadline; a header with the shape and dtype goes once per stage and step,
// so stages may change shapes (the first may take integer ids), but every micro-batch of a step
// must leave a stage with one shape (InvalidArgument naming both otherwise). Schedules:
//   kGPipe: every micro-batch's forward, then every backward (m activations alive per stage);
//   k1F1B: p - s - 1 forwards to fill the pipeline, then one forward and one backward in turn,
//          then the remaining backwards (at most p - s activations alive); bubble
//          (p - 1) / (m + p - 1) of the step at equal stage times;
//   kInterleaved1F1B: Megatron's schedule over v chunks per rank (m a multiple of p); the
//          bubble shrinks by v.
// Every rank of the group calls step() with the same micro-batch count; ranks of one pipeline
// read the same batch (the first stage uses the inputs, the last the targets). A dead or stuck
// peer is a Timeout (or CommError) from step() within `timeout`, naming the transfer, the
// micro-batch and the peer stage. A Pipeline is used from one thread; its group must outlive it.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/config.h"
#include "loom/visibility.h"

namespace loom::parallel {

enum class Schedule { kGPipe, k1F1B, kInterleaved1F1B };
LOOM_API const char* to_string(Schedule schedule);

struct PipelineOptions {
  Schedule schedule = Schedule::k1F1B;
  int micro_batches = 4;  // m: the batch is cut into m equal pieces along dim 0
  std::chrono::milliseconds timeout = comm::kDefaultCollectiveTimeout;  // each transfer's wait
};

// The config keys of a pipeline (part of the Runtime's schema, beside parallel.pp):
// parallel.pp_schedule (gpipe, 1f1b or interleaved-1f1b), parallel.pp_micro_batches (m) and
// parallel.pp_chunks (v: model chunks per pipeline rank; above 1 only for interleaved-1f1b).
LOOM_API ConfigSchema pipeline_schema();
// The schedule and micro-batch count those keys give (timeout: the default); ConfigError
// naming the key for a bad value.
LOOM_API PipelineOptions pipeline_options_from(const Config& config);
// parallel.pp_chunks, checked against the schedule (ConfigError naming both).
LOOM_API int pipeline_chunks_from(const Config& config);

// A chunk of the model: its input (the previous stage's output, or the batch's micro-batch for
// the first stage) to its output (the next stage's input, or what the loss takes).
using StageFn = std::function<at::Tensor(const at::Tensor& input)>;
// The last stage's loss of one micro-batch: its output and its targets to a scalar (a mean
// over the micro-batch; step() divides it by m, so the gradients are the batch mean's).
using PipelineLossFn =
    std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

// Time of the last step on this rank.
struct PipelineStats {
  double step_seconds = 0;     // the whole step
  double compute_seconds = 0;  // inside the stage functions, their backward and the loss
  double wait_seconds = 0;     // waiting for activations or gradients from peers
  // The share of the step this rank's stage spent not computing: (step - compute) / step.
  double bubble() const { return step_seconds > 0 ? 1.0 - compute_seconds / step_seconds : 0; }
};

// One action of a rank's schedule.
struct PipelineAction {
  enum Kind { kForward, kBackward } kind;
  int micro_batch;
  int chunk;  // this rank's chunk (0 unless interleaved)
};
// The order in which pipeline rank `rank` of `stages` (p) runs its forwards and backwards of
// `micro_batches` micro-batches with `chunks` chunks per rank. InvalidArgument naming the
// numbers when the schedule cannot run them (interleaved: m not a multiple of p).
LOOM_API std::vector<PipelineAction> pipeline_schedule(Schedule schedule, int rank, int stages,
                                                       int micro_batches, int chunks = 1);
// The schedule's bubble at equal stage times, forward time f and backward time b per
// micro-batch and chunk: (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1)
// interleaved.
LOOM_API double theoretical_bubble(Schedule schedule, int stages, int micro_batches,
                                   int chunks = 1);

class LOOM_API Pipeline {
 public:
  // `chunks`: this rank's stage (one; or v for kInterleaved1F1B, in chunk order). InvalidArgument
  // when their number does not fit the schedule or m < 1.
  Pipeline(comm::Group& group, std::vector<StageFn> chunks, PipelineOptions options = {});

  // One training step's forward and backward: the gradients of every micro-batch accumulate
  // into whatever the stage functions use (call zero_grad before, step the optimizer after).
  // `inputs` and `targets` are the whole batch (dim 0 divisible by m); the first stage reads
  // inputs, the last targets. Returns the batch's loss (the mean of the micro-batches'),
  // the same on every rank.
  double step(const at::Tensor& inputs, const at::Tensor& targets, const PipelineLossFn& loss);

  const PipelineStats& stats() const { return stats_; }
  const PipelineOptions& options() const { return options_; }
  int stage_count() const { return group_.size(); }

 private:
  comm::Group& group_;
  std::vector<StageFn> chunks_;
  PipelineOptions options_;
  std::vector<PipelineAction> actions_;  // this rank's schedule
  PipelineStats stats_;
};

}  // namespace loom::parallel
