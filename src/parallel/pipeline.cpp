// Pipeline parallelism: the three schedules as per-rank action lists, and the runner that
// executes one list with send/recv of activations and gradients between stages.
#include "loom/parallel/pipeline.h"

#include <torch/torch.h>

#include <map>

#include "loom/error.h"
#include "util/deadline.h"
#include "util/dtype.h"

namespace loom::parallel {

namespace {

using Clock = std::chrono::steady_clock;
using util::seconds_since;

std::vector<PipelineAction> gpipe(int micro_batches) {
  std::vector<PipelineAction> out;
  for (int mb = 0; mb < micro_batches; ++mb) out.push_back({PipelineAction::kForward, mb, 0});
  for (int mb = 0; mb < micro_batches; ++mb) out.push_back({PipelineAction::kBackward, mb, 0});
  return out;
}

std::vector<PipelineAction> one_f_one_b(int rank, int stages, int micro_batches) {
  const int warmup = std::min(stages - rank - 1, micro_batches);
  std::vector<PipelineAction> out;
  for (int mb = 0; mb < warmup; ++mb) out.push_back({PipelineAction::kForward, mb, 0});
  for (int i = 0; i < micro_batches - warmup; ++i) {
    out.push_back({PipelineAction::kForward, warmup + i, 0});
    out.push_back({PipelineAction::kBackward, i, 0});
  }
  for (int mb = micro_batches - warmup; mb < micro_batches; ++mb) {
    out.push_back({PipelineAction::kBackward, mb, 0});
  }
  return out;
}

// Megatron-LM's interleaved schedule (forward_backward_pipelining_with_interleaving): the k-th
// forward of a rank runs chunk (k mod pv) / p on micro-batch (k / pv) p + k mod p; backwards
// visit the chunks in reverse.
std::vector<PipelineAction> interleaved(int rank, int stages, int micro_batches, int chunks) {
  const int p = stages, v = chunks, total = micro_batches * chunks;
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  auto micro_batch_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  int warmup = std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  if (micro_batches == p) warmup = total;  // Megatron: every forward first when m == p
  std::vector<PipelineAction> out;
  for (int k = 0; k < warmup; ++k) {
    out.push_back({PipelineAction::kForward, micro_batch_of(k), chunk_of(k, true)});
  }
  for (int k = 0; k < total - warmup; ++k) {
    const int f = warmup + k;
    out.push_back({PipelineAction::kForward, micro_batch_of(f), chunk_of(f, true)});
    out.push_back({PipelineAction::kBackward, micro_batch_of(k), chunk_of(k, false)});
  }
  for (int k = total - warmup; k < total; ++k) {
    out.push_back({PipelineAction::kBackward, micro_batch_of(k), chunk_of(k, false)});
  }
  return out;
}

// The header that precedes every activation or gradient: dtype, ndim, then the sizes.
constexpr int64_t kMaxDims = 8;
at::Tensor header_of(const at::Tensor& t) {
  LOOM_CHECK(t.dim() <= kMaxDims, InvalidArgument, "Pipeline: a stage's output has ", t.dim(),
             " dims; at most ", kMaxDims, " travel between stages");
  at::Tensor h = torch::zeros({2 + kMaxDims}, torch::kLong);
  auto* p = h.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(t.scalar_type());
  p[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) p[2 + d] = t.size(d);
  return h;
}

}  // namespace

ConfigSchema pipeline_schema() {
  ConfigSchema s;
  s.add("parallel.pp_schedule", "1f1b",
        "pipeline schedule under parallel.pp > 1: gpipe, 1f1b or interleaved-1f1b");
  s.add("parallel.pp_micro_batches", 4,
        "micro-batches each pipeline step cuts its batch into (m; the bubble is (pp - 1) / (m + "
        "pp - 1))");
  s.add("parallel.pp_chunks", 1,
        "model chunks per pipeline rank (v); above 1 only for interleaved-1f1b (bubble / v)");
  return s;
}

PipelineOptions pipeline_options_from(const Config& config) {
  PipelineOptions o;
  const std::string schedule = config.get<std::string>("parallel.pp_schedule");
  bool known = false;
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B}) {
    if (schedule == to_string(s)) {
      o.schedule = s;
      known = true;
    }
  }
  LOOM_CHECK(known, ConfigError, "parallel.pp_schedule is '", schedule,
             "'; use gpipe, 1f1b or interleaved-1f1b");
  const int64_t m = config.get<int64_t>("parallel.pp_micro_batches");
  LOOM_CHECK(m >= 1, ConfigError, "parallel.pp_micro_batches must be at least 1, got ", m);
  o.micro_batches = static_cast<int>(m);
  return o;
}

int pipeline_chunks_from(const Config& config) {
  const int64_t v = config.get<int64_t>("parallel.pp_chunks");
  const bool interleaved = pipeline_options_from(config).schedule == Schedule::kInterleaved1F1B;
  LOOM_CHECK(v >= 1 && (v == 1 || interleaved), ConfigError, "parallel.pp_chunks is ", v,
             " with parallel.pp_schedule ", config.get<std::string>("parallel.pp_schedule"),
             "; it must be at least 1, and above 1 only with interleaved-1f1b");
  return static_cast<int>(v);
}

const char* to_string(Schedule schedule) {
  switch (schedule) {
    case Schedule::kGPipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
    case Schedule::kInterleaved1F1B:
      return "interleaved-1f1b";
  }
  return "?";
}

std::vector<PipelineAction> pipeline_schedule(Schedule schedule, int rank, int stages,
                                              int micro_batches, int chunks) {
  LOOM_CHECK(stages >= 1 && rank >= 0 && rank < stages && micro_batches >= 1 && chunks >= 1,
             InvalidArgument, "pipeline schedule: rank ", rank, " of ", stages, " stages, ",
             micro_batches, " micro-batches, ", chunks,
             " chunks per rank; need 0 <= rank < stages and at least one of each");
  switch (schedule) {
    case Schedule::kGPipe:
    case Schedule::k1F1B:
      LOOM_CHECK(chunks == 1, InvalidArgument, "the ", to_string(schedule), " schedule runs one ",
                 "chunk per rank, got ", chunks, "; use interleaved-1f1b for more");
      return schedule == Schedule::kGPipe ? gpipe(micro_batches)
                                          : one_f_one_b(rank, stages, micro_batches);
    case Schedule::kInterleaved1F1B:
      LOOM_CHECK(micro_batches % stages == 0, InvalidArgument,
                 "the interleaved-1f1b schedule needs the micro-batches (", micro_batches,
                 ") to be a multiple of the pipeline stages (", stages, ")");
      return interleaved(rank, stages, micro_batches, chunks);
  }
  return {};
}

double theoretical_bubble(Schedule schedule, int stages, int micro_batches, int chunks) {
  const double p = stages, m = micro_batches;
  const double v = schedule == Schedule::kInterleaved1F1B ? chunks : 1;
  return (p - 1) / (v * m + p - 1);
}

Pipeline::Pipeline(comm::Group& group, std::vector<StageFn> chunks, PipelineOptions options)
    : group_(group), chunks_(std::move(chunks)), options_(options) {
  LOOM_CHECK(!chunks_.empty(), InvalidArgument, "Pipeline: no stage function given");
  LOOM_CHECK(options_.micro_batches >= 1, InvalidArgument, "Pipeline: ", options_.micro_batches,
             " micro-batches; use at least 1");
  // Checks the combination here rather than at the first step; every step runs this list.
  actions_ = pipeline_schedule(options_.schedule, group_.rank(), group_.size(),
                               options_.micro_batches, static_cast<int>(chunks_.size()));
}

namespace {

using Kind = PipelineAction::Kind;

// One step's activations and gradients between the virtual stages of `group`'s ranks. Each
// (direction, receiving virtual stage) is a stream whose micro-batches all have the shape and
// dtype of the first: a header with them goes once per stream and step, and the receiver posts
// the recvs of the next micro-batches ahead of need, so that a transfer is one message whose
// recv is usually posted already (a Gloo send completes only once its recv is posted).
class StepTransfers {
 public:
  // Posts the header recvs of every stream into this rank's `chunks` virtual stages. Headers
  // and received tensors live on `device` (the batch's: a device group takes device tensors).
  StepTransfers(comm::Group& group, const PipelineOptions& options, int chunks,
                const at::Device& device, PipelineStats& stats)
      : group_(group),
        options_(options),
        p_(group.size()),
        m_(options.micro_batches),
        last_stage_(group.size() * chunks - 1),
        device_(device),
        stats_(stats) {
    for (int j = 0; j < chunks; ++j) {
      const int stage = j * p_ + group.rank();
      for (const Kind kind : {PipelineAction::kForward, PipelineAction::kBackward}) {
        if ((kind == PipelineAction::kForward && stage == 0) ||
            (kind == PipelineAction::kBackward && stage == last_stage_)) {
          continue;
        }
        Incoming& in = incoming_[{kind, stage}];
        in.header = torch::empty({2 + kMaxDims}, torch::dtype(torch::kLong).device(device_));
        in.header_work = group_.recv(in.header, sender_of(kind, stage) % p_,
                                     {.tag = tag(kind, stage, 0, 0), .timeout = options_.timeout});
      }
    }
  }

  // Sends micro-batch mb's tensor of stream (kind, receiver) to the receiver's rank.
  void send(const at::Tensor& t, int receiver, Kind kind, int mb) {
    const int dst = receiver % p_;
    Pending out{nullptr, at::Tensor(), t.contiguous()};
    const auto it = sent_.find({kind, receiver});
    if (it == sent_.end()) {
      out.header = header_of(t).to(t.device());
      group_.send(out.header, dst, {.tag = tag(kind, receiver, 0, 0), .timeout = options_.timeout});
      sent_[{kind, receiver}] = {t.sizes().vec(), t.scalar_type()};
    } else {
      LOOM_CHECK(it->second.first == t.sizes().vec() && it->second.second == t.scalar_type(),
                 InvalidArgument, "Pipeline: stage ", sender_of(kind, receiver), " sends ",
                 t.sizes(), " ", util::dtype_name(t.scalar_type()), " for micro-batch ", mb,
                 " but ", at::IntArrayRef(it->second.first), " ",
                 util::dtype_name(it->second.second),
                 " for the first of the step; every micro-batch of a step must have one shape");
    }
    out.work = group_.send(out.payload, dst,
                           {.tag = tag(kind, receiver, mb, 1), .timeout = options_.timeout});
    sends_.push_back(std::move(out));
  }

  // Micro-batch mb's tensor of stream (kind, receiver), waited for up to the timeout.
  at::Tensor receive(int receiver, Kind kind, int mb) {
    const Clock::time_point wait_start = Clock::now();
    Incoming& in = incoming_.at({kind, receiver});
    if (in.shape.empty()) {
      wait(in.header_work, receiver, kind, mb);
      const at::Tensor host = in.header.cpu();
      const auto* h = host.data_ptr<int64_t>();
      in.shape.assign(h + 2, h + 2 + h[1]);
      in.dtype = static_cast<at::ScalarType>(h[0]);
    }
    for (int k = mb; k <= std::min(mb + kLookahead, m_ - 1); ++k) {
      if (in.posted.count(k) != 0) continue;
      at::Tensor payload = torch::empty(in.shape, torch::dtype(in.dtype).device(device_));
      comm::WorkPtr work =
          group_.recv(payload, sender_of(kind, receiver) % p_,
                      {.tag = tag(kind, receiver, k, 1), .timeout = options_.timeout});
      in.posted[k] = {payload, work};
    }
    auto [payload, work] = std::move(in.posted.at(mb));
    in.posted.erase(mb);
    wait(work, receiver, kind, mb);
    stats_.wait_seconds += seconds_since(wait_start);
    return payload;
  }

  // Waits for every send of the step.
  void finish() {
    for (Pending& out : sends_) out.work->wait(options_.timeout);
  }

 private:
  static constexpr int kLookahead = 2;  // recvs posted ahead per stream
  using Stream = std::pair<int, int>;   // (kind, receiving virtual stage)
  struct Pending {
    comm::WorkPtr work;
    at::Tensor header, payload;  // alive until the send completes
  };
  struct Incoming {
    at::Tensor header;
    comm::WorkPtr header_work;
    std::vector<int64_t> shape;  // empty until the header came
    at::ScalarType dtype = at::kFloat;
    std::map<int, std::pair<at::Tensor, comm::WorkPtr>> posted;  // by micro-batch
  };

  static int sender_of(Kind kind, int receiver) {
    return kind == PipelineAction::kForward ? receiver - 1 : receiver + 1;
  }
  // Tags name the direction, the receiving virtual stage, the micro-batch and the part.
  int tag(Kind kind, int receiver, int mb, int part) const {
    return ((static_cast<int>(kind) * (last_stage_ + 1) + receiver) * m_ + mb) * 2 + part;
  }
  // The work's wait, its error naming the schedule, the stages and the micro-batch.
  void wait(const comm::WorkPtr& work, int receiver, Kind kind, int mb) const {
    auto context = [&](const Error& e) {
      const int sender = sender_of(kind, receiver);
      return detail::concat(
          "Pipeline (", to_string(options_.schedule), "): stage ", receiver, " waiting for the ",
          kind == PipelineAction::kForward ? "activation" : "gradient", " of micro-batch ", mb,
          " from stage ", sender, " (pipeline rank ", sender % p_, "): ", e.what());
    };
    try {
      work->wait(options_.timeout);
    } catch (const Timeout& e) {
      throw Timeout(context(e));
    } catch (const CommError& e) {
      throw CommError(context(e));
    }
  }

  comm::Group& group_;
  const PipelineOptions& options_;
  const int p_, m_, last_stage_;
  const at::Device device_;
  PipelineStats& stats_;
  std::vector<Pending> sends_;
  std::map<Stream, std::pair<std::vector<int64_t>, at::ScalarType>> sent_;
  std::map<Stream, Incoming> incoming_;
};

}  // namespace

double Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets,
                      const PipelineLossFn& loss_fn) {
  const int p = group_.size(), s = group_.rank(), m = options_.micro_batches;
  const int v = static_cast<int>(chunks_.size()), last_stage = p * v - 1;
  LOOM_CHECK(inputs.size(0) % m == 0 && targets.size(0) == inputs.size(0), InvalidArgument,
             "Pipeline: a batch of ", inputs.size(0), " rows (targets ", targets.size(0),
             ") does not split into ", m, " equal micro-batches");
  const int64_t rows = inputs.size(0) / m;
  const Clock::time_point start = Clock::now();
  stats_ = {};
  StepTransfers transfers(group_, options_, v, inputs.device(), stats_);

  // What a micro-batch's forward left for its backward, by (chunk, micro-batch).
  struct InFlight {
    at::Tensor input, output;  // output: the loss on the last stage
  };
  std::map<std::pair<int, int>, InFlight> in_flight;
  double loss_sum = 0;
  for (const PipelineAction& a : actions_) {
    const int stage = a.chunk * p + s;
    if (a.kind == PipelineAction::kForward) {
      at::Tensor input = stage == 0
                             ? inputs.narrow(0, rows * a.micro_batch, rows)
                             : transfers.receive(stage, PipelineAction::kForward, a.micro_batch);
      if (stage > 0 && input.is_floating_point()) input.requires_grad_(true);
      const Clock::time_point compute_start = Clock::now();
      at::Tensor output = chunks_[static_cast<size_t>(a.chunk)](input);
      if (stage == last_stage) {
        output = loss_fn(output, targets.narrow(0, rows * a.micro_batch, rows)) / m;
        loss_sum += output.detach().item<double>();
      }
      stats_.compute_seconds += seconds_since(compute_start);
      if (stage != last_stage) {
        transfers.send(output.detach(), stage + 1, PipelineAction::kForward, a.micro_batch);
      }
      in_flight[{a.chunk, a.micro_batch}] = {input, output};
    } else {
      InFlight f = std::move(in_flight.at({a.chunk, a.micro_batch}));
      in_flight.erase({a.chunk, a.micro_batch});
      const at::Tensor grad =
          stage == last_stage ? at::Tensor()
                              : transfers.receive(stage, PipelineAction::kBackward, a.micro_batch);
      const Clock::time_point compute_start = Clock::now();
      if (stage == last_stage) {
        f.output.backward();
      } else {
        f.output.backward(grad);
      }
      stats_.compute_seconds += seconds_since(compute_start);
      if (stage > 0 && f.input.requires_grad()) {
        transfers.send(f.input.grad(), stage - 1, PipelineAction::kBackward, a.micro_batch);
      }
    }
  }
  transfers.finish();
  // The loss from the last stage's rank to every rank.
  at::Tensor loss =
      torch::full({1}, loss_sum, torch::dtype(torch::kDouble).device(inputs.device()));
  group_.broadcast(loss, {.root = last_stage % p, .timeout = options_.timeout})
      ->wait(options_.timeout);
  stats_.step_seconds = seconds_since(start);
  return loss.item<double>();
}

}  // namespace loom::parallel
