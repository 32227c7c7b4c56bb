// bench_train: training steps of a decoder-only transformer, Loom beside the plain way. Each
// mode is a file of benchmarks/bench_train/; this one parses the command line.
//
// --mode=ddp: one training step of a ~20M-parameter model on N ranks as processes (Gloo over
// a FileStore, loopback TCP), for
//   baseline   the plain way of libtorch C++ examples: backward, then one all-reduce per
//              parameter gradient, then torch::optim::AdamW;
//   ddp        Loom's DataParallel: bucketed all-reduce overlapped with backward, torch AdamW;
//   zero1/2    DataParallel with ZeRO-1 / ZeRO-2 and Loom's sharded AdamW;
// plus the share of communication that overlap hides and the optimizer-state bytes per rank.
//
// --mode=trainer: train::Trainer's step time (a ~3M-parameter model, 1 and 2 ranks) beside
//   hand_dp      a hand-written loop over the same DataParallel and Loom AdamW: what the
//                Trainer adds on top (its target: at most 3% slower);
//   hand_plain   the plain libtorch loop: torch AdamW, clip_grad_norm_, and at 2 ranks one
//                all-reduce per gradient after backward;
//   python_ddp   the same model in Python, torch.nn.parallel.DistributedDataParallel (gloo),
//                2 processes (skipped with a note when python3 or torch is missing).
// Every loop reads the same token batches (one data::Reader each, same dataset and options),
// clips the gradient norm to 1 and takes the loss with .item().
//
// --mode=trace: the Trainer's step with tracing on (metrics.trace_steps) beside its untraced
// steps in the same run (the 3M model, 2 ranks), the step that writes the trace file, and the
// estimated cost of tracing off (a measured atomic check times the sites a step passes).
//
// --mode=sharding: the GPT example's model (~20M parameters in a large model's proportions by
// default: 32 blocks of width 224, a 4096-entry vocabulary that is 4.5% of the parameters) on
// W = 2 and 4 ranks as processes, under DDP, ZeRO-1, ZeRO-2 (1 MiB buckets), FSDP (each block
// a unit) and FSDP with activation checkpointing:
// step time beside DDP's (cold and warm; FSDP without prefetch too, to show what prefetch
// hides), and each case's peak bytes per rank of parameters, gradients, optimizer state and
// activations, counted from the CPU allocator (metrics/allocations.h), each case alone.
//
// --mode=pipeline: parallel::Pipeline's bubble under GPipe, 1F1B and interleaved 1F1B (p = 4
// stages, m = 8 micro-batches by default) beside the theoretical (p - 1) / (m + p - 1), with
// timed-wait stages so the 2-core machine measures the schedule rather than its cores.
//
// --mode=model-parallel: the GPT example's model (8 blocks of width 128, 4 heads, vocabulary
// 1024 by default) split by tensor parallelism (tp = 1, 2, 4), into pipeline stages (pp = 2, 4
// under GPipe, 1F1B and interleaved 1F1B with 2 chunks per rank; m = 8 micro-batches) and over
// pp 2 x dp 2 x tp 2, ranks as processes (8, each split on the first pp x dp x tp of them),
// beside the same model and global batch (--batch) trained unsplit in one process, rounds
// interleaved: step time, each rank's peak bytes of parameters + gradients and of activations,
// and the pipelines' measured bubble beside the theoretical one. Up to 8 processes share this
// machine's cores, so the times show what splitting costs, not a speedup.
//
// ratio = baseline / Loom for times (above 1: Loom is faster), replicated / Loom for bytes.
//
//   bench_train --mode=ddp               2 ranks, the 20M model, table
//   bench_train --mode=trainer           1 and 2 ranks, the 3M model, table
//   bench_train --mode=trace             2 ranks, the 3M model, tracing on and off
//   bench_train --mode=sharding          2 and 4 ranks, the 20M GPT, table
//   bench_train --mode=pipeline          4 stages, 8 micro-batches, the three schedules
//   bench_train --mode=model-parallel    tp, pp and pp x dp x tp beside one process, table
//   bench_train --mode=... --json        JSON rows
#include <CLI/CLI.hpp>

#include <iostream>

#include "bench_train.h"

namespace {

using bench_train::Settings;

// field = value unless `option` was given.
template <typename T>
void fallback(const CLI::App& app, const char* option, T& field, T value) {
  if (app.count(option) == 0) field = value;
}

// --mode=trainer's model: a step of ~50-200 ms on one core of the 2-core benchmark machine.
void use_trainer_defaults(Settings& s, const CLI::App& app) {
  fallback(app, "--vocab", s.vocab, int64_t{2048});
  fallback(app, "--dim", s.dim, int64_t{256});
  fallback(app, "--layers", s.layers, int64_t{3});
  fallback(app, "--heads", s.heads, int64_t{4});
  fallback(app, "--seq", s.seq, int64_t{64});
  fallback(app, "--batch", s.batch, int64_t{4});
  fallback(app, "--steps", s.steps, 30);
  fallback(app, "--warmup", s.warmup, 3);
}

// --mode=model-parallel's model: whole heads and vocabulary rows at tp = 4, a block per virtual
// stage at pp = 4 with 2 chunks, a micro-batch of one sequence; the mode in 1-2 minutes on the
// 2-core benchmark machine.
void use_model_parallel_defaults(Settings& s, const CLI::App& app) {
  fallback(app, "--vocab", s.vocab, int64_t{1024});
  fallback(app, "--dim", s.dim, int64_t{128});
  fallback(app, "--layers", s.layers, int64_t{8});
  fallback(app, "--heads", s.heads, int64_t{4});
  fallback(app, "--seq", s.seq, int64_t{64});
  fallback(app, "--batch", s.batch, int64_t{8});
  fallback(app, "--steps", s.steps, 16);
  fallback(app, "--warmup", s.warmup, 2);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"bench_train: parallel training steps, Loom beside the plain way"};
  app.add_option("--mode", s.mode,
                 "what to measure: ddp, trainer, trace, sharding, pipeline or model-parallel")
      ->check(CLI::IsMember({"ddp", "trainer", "trace", "sharding", "pipeline", "model-parallel"}));
  app.add_option("--ranks", s.ranks, "ranks (processes)")->check(CLI::Range(1, 64));
  app.add_option("--vocab", s.vocab, "vocabulary size");
  app.add_option("--dim", s.dim, "model width");
  app.add_option("--layers", s.layers, "transformer blocks");
  app.add_option("--heads", s.heads, "attention heads");
  app.add_option("--seq", s.seq, "tokens per sequence");
  app.add_option("--batch", s.batch,
                 "sequences per rank per step (--mode=model-parallel: the global batch)");
  app.add_option("--steps", s.steps, "measured steps per case")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", s.warmup, "unmeasured steps per case");
  app.add_option("--threads", s.threads, "intra-op threads per rank");
  app.add_option("--bucket-mib", s.bucket_mib, "DataParallel bucket size in MiB");
  app.add_option("--zero2-bucket-mib", s.zero2_bucket_mib,
                 "--mode=sharding: ZeRO-2's bucket size in MiB (DDP and ZeRO-1 use --bucket-mib)");
  app.add_option("--micro-batches", s.micro_batches,
                 "--mode=pipeline and model-parallel: micro-batches per step")
      ->check(CLI::Range(1, 1024));
  app.add_option("--forward-ms", s.forward_ms,
                 "--mode=pipeline: a stage's forward per micro-batch (backward: twice)");
  app.add_flag("--json", s.json, "print one JSON object per row");
  app.add_option("--python", s.python, "--mode=trainer: the Python with torch for the DDP peer")
      ->capture_default_str();
  app.add_option("--worker-rank", s.worker_rank, "internal: run as this rank")->group("");
  app.add_option("--store-dir", s.store_dir, "internal: rendezvous directory")->group("");
  app.add_option("--dataset", s.dataset, "internal: the token dataset")->group("");
  app.add_option("--baton", s.baton, "internal: turn-taking directory with Python DDP")->group("");
  CLI11_PARSE(app, argc, argv);
  const bool trainer = s.mode == "trainer";
  const bool trace = s.mode == "trace";
  const bool sharding = s.mode == "sharding";
  const bool model_parallel = s.mode == "model-parallel";
  if (trainer || trace) use_trainer_defaults(s, app);
  if (model_parallel) use_model_parallel_defaults(s, app);
  if (trace) {
    if (app.count("--ranks") == 0) s.ranks = 2;
    if (app.count("--steps") == 0) s.steps = 24;  // cycles of 8 steps
    if (app.count("--warmup") == 0) s.warmup = 8;
  }
  // --mode=sharding: ~20M parameters in a large model's proportions (many blocks, the tied
  // embedding a few percent of the model, as Llama 3 8B's is 6.5%); W = 2 and 4 unless --ranks
  // is given. The earlier default, vocab 16384 x 8 blocks of width 384 (the embedding 31%), is
  // --vocab=16384 --layers=8 --dim=384 --heads=6.
  if (sharding) {
    fallback(app, "--vocab", s.vocab, int64_t{4096});
    fallback(app, "--layers", s.layers, int64_t{32});
    fallback(app, "--dim", s.dim, int64_t{224});
    fallback(app, "--heads", s.heads, int64_t{7});
  }
  const std::vector<int> sharding_worlds =
      app.count("--ranks") > 0 ? std::vector<int>{s.ranks} : std::vector<int>{2, 4};
  try {
    if (s.mode == "pipeline") {
      if (app.count("--ranks") == 0) s.ranks = 4;
      if (app.count("--steps") == 0) s.steps = 5;
      return bench_train::run_pipeline(s);
    }
    if (s.worker_rank >= 0) {
      if (trainer) {
        bench_train::run_trainer_worker(s);
      } else if (trace) {
        bench_train::run_trace_worker(s);
      } else if (sharding) {
        bench_train::run_sharding_worker(s);
      } else if (model_parallel) {
        bench_train::run_model_parallel_worker(s);
      } else {
        bench_train::run_ddp_worker(s);
      }
      return 0;
    }
    if (sharding) return bench_train::run_sharding_parent(s, "/proc/self/exe", sharding_worlds);
    if (model_parallel) return bench_train::run_model_parallel_parent(s, "/proc/self/exe");
    if (trace) return bench_train::run_trace_parent(s, "/proc/self/exe");
    return trainer ? bench_train::run_trainer_parent(s, "/proc/self/exe")
                   : bench_train::run_parent(s, "/proc/self/exe");
  } catch (const std::exception& e) {
    std::cerr << "bench_train: error: " << e.what() << std::endl;
    return 1;
  }
}
