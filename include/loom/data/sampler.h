// The deterministic global sample order: which sample indices each rank reads at each step.
//
// Every epoch's order is a keyed permutation of [0, num_samples) chosen by (seed, epoch).
// Each step consumes the next global batch (per_rank_batch * world_size samples) of that
// order, and rank r takes the r-th contiguous slice of it. The whole reader position is one
// SamplerState {dataset_version, seed, epoch, position}, where position counts the samples
// of the epoch consumed by all ranks together, so a state saved at one world size resumes
// exactly at any other: no sample of the epoch is repeated or skipped. See
// docs/data-order.md for the algorithm, the epoch-end policies and a worked example.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::data {

// Where a reader stands in the sample order. Identical on every rank after every step.
struct LOOM_API SamplerState {
  std::string dataset_version;  // names the dataset's content; the order depends on it
  uint64_t seed = 0;            // keys the order, with epoch
  uint64_t epoch = 0;           // epochs completed so far
  uint64_t position = 0;        // samples of this epoch's order consumed by all ranks together
  // The registry version the dataset was opened as ("kjv@3"), or "" when opened by path. A
  // label for people and messages: dataset_version is what restore() compares, and == ignores it.
  std::string dataset;

  // A JSON object with these four fields (and "dataset" when set) plus the name of the order
  // algorithm. Integers are JSON numbers and keep all 64 bits.
  std::string to_json() const;
  // Parses to_json()'s output ("dataset" optional). Malformed JSON or a missing or mistyped
  // field is loom::CorruptData; a state written by a different order algorithm is
  // InvalidArgument (its positions would point into another order).
  static SamplerState from_json(const std::string& json);

  friend bool operator==(const SamplerState& a, const SamplerState& b) {
    return a.dataset_version == b.dataset_version && a.seed == b.seed && a.epoch == b.epoch &&
           a.position == b.position;
  }
  friend bool operator!=(const SamplerState& a, const SamplerState& b) { return !(a == b); }
};

// What to do with the samples left at the end of an epoch when they do not fill a global batch.
enum class EpochEnd {
  // Skip them: every step sees a full global batch; the last num_samples % global_batch
  // samples of each epoch's order (different samples each epoch) are not read that epoch.
  kDropLast,
  // Complete the last global batch with the first samples of the same epoch's order (wrapping
  // as often as needed) and mark them as padding: the epoch reads every sample exactly once,
  // plus the marked padding.
  kPad,
};

struct SamplerOptions {
  uint64_t num_samples = 0;                  // dataset size, in [1, 2^63]
  uint64_t seed = 0;                         // keys the order; the same on every rank
  uint64_t per_rank_batch = 1;               // samples each rank reads per step (>= 1)
  int rank = 0;                              // this rank, in [0, world_size)
  int world_size = 1;                        // ranks reading together
  EpochEnd epoch_end = EpochEnd::kDropLast;  // see EpochEnd
  std::string dataset_version;               // compared with a restored state's dataset_version
  std::string dataset;                       // the registry version, for states and messages
};

struct RestoreOptions {
  // Accept a state whose dataset_version differs from the sampler's. The epoch and position
  // are kept, but the order depends on num_samples, so the rest of that epoch is not an exact
  // continuation if the size changed; a position beyond the new size ends the epoch.
  bool allow_version_change = false;
};

// One rank's sample indices for one step, for the dataset reader to load.
struct IndexBatch {
  // Sample indices, per_rank_batch of them. The first num_real are real samples; the rest
  // (only in the last batch of an epoch under EpochEnd::kPad) are padding that repeats
  // samples of the same epoch and should be masked out of the loss and the metrics.
  std::vector<uint64_t> indices;
  uint64_t num_real = 0;
  uint64_t epoch = 0;     // the epoch these samples belong to
  uint64_t position = 0;  // the global position of the first sample of this step's global batch
};

// The sample order of one rank. Every rank builds one with the same options except rank and
// calls next_batch() once per step; all ranks' states stay identical.
//
// A GlobalSampler is a small value (O(1) memory whatever num_samples): copyable, not safe to
// use from several threads at once. The constructor throws InvalidArgument on bad options.
class LOOM_API GlobalSampler {
 public:
  explicit GlobalSampler(SamplerOptions options);

  // This rank's slice of the next global batch; advances the state by one global batch
  // (and into the next epoch when this one is exhausted).
  IndexBatch next_batch();

  // The state after the last next_batch(): saving it and restoring it (at any world size or
  // batch size) continues with the batch the next next_batch() would have given.
  SamplerState state() const;

  // Continues from state: the next global batch starts at state.position of state.epoch's
  // order, whatever this sampler's world size and per-rank batch. InvalidArgument, naming
  // both values, when the seed differs or the dataset_version differs (unless
  // options.allow_version_change), or when position exceeds num_samples for the same version.
  void restore(const SamplerState& state, RestoreOptions options = {});

  uint64_t global_batch() const { return global_batch_; }
  // Steps in one epoch started at position 0.
  uint64_t steps_per_epoch() const;
  const SamplerOptions& options() const { return options_; }

 private:
  // Moves to the next epoch when no batch is left in this one under the epoch-end policy.
  void finish_epoch_if_exhausted();

  // Constant after construction.
  SamplerOptions options_;
  uint64_t global_batch_;
  // The position in the order; always the start of a batch that next_batch() will give.
  uint64_t epoch_ = 0;
  uint64_t position_ = 0;
};

}  // namespace loom::data
