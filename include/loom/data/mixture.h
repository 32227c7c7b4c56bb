// data::Mixture: one rank's batches drawn from several datasets with weights, in a global order
// that is a function of the seed alone, resumable exactly at any world size and batch size.
//
//   loom::data::Mixture mix({{.dataset = "web@3", .weight = 0.7},
//                            {.dataset = "code@1", .weight = 0.2},
//                            {.dataset = "data/books", .weight = 0.1,
//                             .epochs = loom::data::SourceEpochs::kStop}},
//                           {.batch_size = 8, .seq_len = 1024, .seed = 1, .rank = r, .world_size =
//                           w});
//   loom::data::Batch b = mix.next();   // b.sources[i]: which dataset row i came from
//
// The order (docs/datasets.md, "Mixing"): the mixture is one stream of sample slots 0, 1, 2,
// ... shared by all ranks. Slot k draws its source from a uniform number keyed by (seed, k)
// against the weights of the sources still in the mix; a source's n-th draw is its n-th sample
// in its own order (epoch n / size, position n % size of a keyed permutation of that dataset,
// as data::Reader orders one dataset), so within a source no sample repeats or is skipped
// within an epoch. Each step takes the next batch_size * world_size slots and rank r the r-th
// contiguous slice. The state is the slot count plus each source's draw count: O(sources),
// identical on every rank, and a state saved at one world size and batch size continues
// exactly at another: the stream of slots does not depend on either.
//
// Epochs are per source: kRepeat starts the source's next epoch (a new order) when one ends;
// kStop takes the source out of the mix after one epoch, and the others' weights are then
// renormalised. When every source is kStop and fewer samples than one global batch remain,
// the mixture is exhausted (the remainder is dropped, as EpochEnd::kDropLast).
//
// Thread safety: one thread at a time. No prefetch thread: each step reads its samples in
// next(). Errors: opening as data::Reader does; sources whose batches cannot be stacked (token
// and record datasets, different fields or shapes) or a weight that is not positive and finite
// are InvalidArgument naming the source; next() on an exhausted mixture is InvalidArgument;
// restore() of another mixture's state is InvalidArgument naming what differs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/data/reader.h"
#include "loom/visibility.h"

namespace loom::data {

enum class SourceEpochs {
  kRepeat,  // after its last sample, the source's next epoch, in a new order
  kStop,    // after one epoch the source leaves the mix
};

struct MixtureSource {
  std::filesystem::path dataset;  // a directory or a registry name, as for data::Reader
  double weight = 1;              // relative share of samples, > 0
  SourceEpochs epochs = SourceEpochs::kRepeat;
};

struct MixtureOptions {
  int64_t batch_size = 1;  // samples per rank per step
  int64_t seq_len = 0;     // token datasets: T (samples hold T + 1 tokens)
  TokenSampling sampling = TokenSampling::kPacked;
  int64_t pad_id = 0;         // kDocument: fills samples shorter than T + 1
  uint64_t seed = 0;          // keys the draws and every source's order; the same on every rank
  int rank = 0;               // this rank, in [0, world_size)
  int world_size = 1;         // ranks reading together
  bool verify_chunks = true;  // as ReaderOptions::verify_chunks
  std::filesystem::path registry;  // where registry names resolve (ReaderOptions::registry)
  // Sources named by URL: as ReaderOptions::remote and ::cache. Their shards are fetched when a
  // batch first needs them (a Mixture has no lookahead).
  RemoteOptions remote;
  CacheOptions cache;
};

// Where a mixture stands. Identical on every rank after every step.
struct LOOM_API MixtureState {
  struct Source {
    std::string dataset_version;  // the source's content version
    std::string dataset;          // its registry version ("" when opened by path); a label
    uint64_t drawn = 0;           // samples taken from it so far, over all its epochs
  };
  uint64_t seed = 0;
  uint64_t slots = 0;  // samples taken by all ranks together, from every source
  std::vector<Source> sources;

  // A JSON object; integers keep all 64 bits. from_json: malformed or mistyped is CorruptData.
  std::string to_json() const;
  static MixtureState from_json(const std::string& json);
};

class LOOM_API Mixture final : public BatchSource {
 public:
  Mixture(std::vector<MixtureSource> sources, MixtureOptions options);
  ~Mixture() override;
  Mixture(const Mixture&) = delete;
  Mixture& operator=(const Mixture&) = delete;

  // The next batch: tensors as data::Reader's (stacked over rows from several sources),
  // indices = each row's sample index in its source, sources = each row's source.
  Batch next() override;
  // Moves on `steps` global batches as next() would, drawing their sources without reading
  // their samples (for tools that show step S: O(S x global batch) draws). Exhaustion is the
  // same InvalidArgument as next()'s, with the steps before it taken.
  void skip(uint64_t steps);
  // True once every source is kStop and fewer than a global batch of samples remain.
  bool exhausted() const;

  MixtureState state() const;
  // Continues exactly after `state` at this mixture's world size and batch size. The seed,
  // the number of sources and each source's dataset_version must match (InvalidArgument
  // naming the first difference).
  void restore(const MixtureState& state);

  // BatchSource: the state as JSON, for checkpoints (the Trainer saves it).
  int64_t batch_size() const override;
  std::string state_json() const override;
  void restore_json(const std::string& json) override;

  // Per-source Readers (for manifests and read()); index as in the constructor's list.
  const Reader& source(size_t i) const;
  size_t num_sources() const;
  // The sources as given to the constructor (datasets, weights, epochs).
  const std::vector<MixtureSource>& sources() const;
  const MixtureOptions& options() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::data
