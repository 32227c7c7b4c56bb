// data::Reader: this rank's batches of a dataset on disk, in the global order of
// GlobalSampler, as tensors ready for a model, prefetched by a background thread.
//
// Token datasets give "tokens" [B, T+1] int64 per batch: each sample is a window of T+1
// tokens (inputs are [:, :T], targets [:, 1:]). Packed sampling cuts the concatenated token
// stream into windows of T+1 tokens that overlap by one (sample i starts at token i*T);
// document sampling gives document i, cut to T+1 tokens or filled with pad_id, and a "mask"
// [B, T+1] bool that is true on real tokens.
// Record datasets give each field collated over the batch: tensor fields [B, ...shape] in
// their dtype (ragged ones padded, with "<name>_mask" [B, L] bool), int fields [B] int64,
// float fields [B] float64; text and bytes fields as strings. Image fields are decoded:
// "<name>" uint8 [B, H, W, C] with H and W the batch's largest (smaller images at the top
// left, zeros around them) and "<name>_size" int64 [B, 2] (each image's height and width);
// an images field gives [B, N, H, W, C], "<name>_size" [B, N, 2] and "<name>_mask" [B, N]
// (which of the N slots hold an image). Images of one batch must have the same channels, or
// options.image_channels converts each (gray to color replicates, color to gray is ITU-R 601
// luma, alpha is dropped or added opaque).
// Episode datasets (RecordLayout::kEpisodes) sample whole episodes, collated as ragged fields
// with "return" float32 [B, T] (the discounted reward to go within the episode) and, when the
// dataset has "value", "advantage" float32 [B, T] (GAE); or single transitions, where every
// per-step field loses its step dimension ([B, ...]) and "episode", "step" int64 [B],
// "return" and "advantage" float32 [B] say where each comes from. Returns and advantages are
// computed in float64 from the stored floats, so they are the same on every rank and run.
// Every batch also says which samples it holds and how many are real (padding appears only in
// the last batch of an epoch under EpochEnd::kPad).
//
// The dataset is never loaded into memory: shards are mmapped and each batch reads only its
// samples. Record checksums are checked on every read; token shards are checked chunk by
// chunk (1 MiB by default), each chunk the first time a read touches it.
//
// A dataset is named by its directory; by a registry name (`kjv@3`, `kjv@latest`,
// `kjv@stable`, `kjv`; loom/data/registry.h), which is a name without '/' that is not an
// existing path; or by the URL of a remote directory (`https://host/kjv`,
// `s3://bucket/kjv`): its shards are fetched through the node cache (loom/data/cache.h) when
// first needed and ahead of need by a lookahead thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/data/batch.h"
#include "loom/data/cache.h"
#include "loom/data/dataset.h"
#include "loom/data/registry.h"
#include "loom/data/sampler.h"
#include "loom/visibility.h"

namespace loom::data {

enum class TokenSampling {
  kPacked,    // windows of seq_len + 1 tokens over the concatenated token stream
  kDocument,  // one document per sample, cut or padded to seq_len + 1
};

// What one sample of an episode dataset is.
enum class EpisodeSampling {
  kEpisode,     // a whole episode
  kTransition,  // one step of an episode; an epoch visits every step of every episode once
};

struct ReaderOptions {
  int64_t batch_size = 1;  // samples per rank per step
  int64_t seq_len = 0;     // token datasets: T (samples hold T + 1 tokens)
  TokenSampling sampling = TokenSampling::kPacked;
  int64_t pad_id = 0;                        // kDocument: fills samples shorter than T + 1
  uint64_t seed = 0;                         // keys the order; the same on every rank
  int rank = 0;                              // this rank, in [0, world_size)
  int world_size = 1;                        // ranks reading together
  EpochEnd epoch_end = EpochEnd::kDropLast;  // what happens to an epoch's last partial batch
  // Episode datasets: what a sample is, and the discount and GAE lambda of "return" and
  // "advantage". Transition sampling reads every episode's length once at open (every record
  // is read and its checksum checked).
  EpisodeSampling episode_sampling = EpisodeSampling::kEpisode;
  double gamma = 0.99;
  double gae_lambda = 0.95;
  // Image fields: channels every decoded image is converted to (1, 2, 3 or 4); 0 = as stored.
  int image_channels = 0;
  int prefetch = 2;            // batches prepared ahead by a background thread; 0 = none
  bool verify_hashes = false;  // hash every shard at open (reads the whole dataset)
  // Token shards: hash each chunk the first time a read touches it (once per chunk per
  // reader). Off only to measure its cost: a flipped byte is then read silently.
  bool verify_chunks = true;
  // Where registry names resolve; empty: $LOOM_DATA_REGISTRY (loom/data/registry.h).
  std::filesystem::path registry;

  // Remote datasets (http://, https://, s3://; loom/data/remote.h and cache.h).
  RemoteOptions remote;  // retries, timeouts, S3 endpoint and credentials
  CacheOptions cache;    // the node cache's directory and byte limit
  // A background thread downloads the shards of the next lookahead_steps steps into the node
  // cache before they are needed, in the order they will be read, while what it fetched for
  // steps not yet taken fits half the cache limit. 0: shards are fetched when a batch needs
  // them.
  int lookahead_steps = 64;
  // Bytes of shards this reader keeps open (pinned in the cache, so not evictable) besides
  // those of the batch being read, least recently used closed first. 0: every shard without a
  // cache limit, a quarter of the limit with one.
  uint64_t open_bytes = 0;
};

// Opens a dataset and yields this rank's batches. Every rank opens the same dataset with the
// same options except rank, and calls next() once per step.
//
// Thread safety: one consumer thread calls next(), state() and restore(); the prefetch thread
// is internal; read() may be called from any thread. Errors: opening a missing dataset, shard
// or tokenizer file is IoError; a truncated shard, a header that does not match the manifest,
// a changed tokenizer file, or (with verify_hashes) a hash mismatch is CorruptData naming the
// file; bad options are InvalidArgument; a registry name that does not resolve is the
// registry's error (resolve_dataset). A record that fails its checksum, or a token chunk that
// fails its hash, is CorruptData from the next() that would return it, naming the shard and
// the record or chunk; that batch is not consumed. A remote dataset's manifest that cannot be
// fetched is RemoteError (an IoError naming the URL, the HTTP status and the attempts) from the
// constructor; a shard that cannot be, RemoteError or CorruptData from the next() that needs
// it, and that batch is not consumed either.
class LOOM_API Reader final : public BatchSource {
 public:
  // `dataset`: a directory, or a registry name resolved through options.registry.
  Reader(const std::filesystem::path& dataset, ReaderOptions options);
  ~Reader() override;
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // The next batch; advances the state by one global batch.
  Batch next() override;

  // The position after the last batch next() returned (prefetched batches not included).
  // Save it with the checkpoint; it is the same on every rank.
  SamplerState state() const;
  // Continues exactly after `state`, at this reader's world size and batch size, whatever
  // they were when it was saved. A state of another dataset version is InvalidArgument
  // naming both versions unless options.allow_version_change; a state of the dataset's
  // previous_version (before a migration) is of this data. O(1): nothing is replayed.
  void restore(const SamplerState& state, RestoreOptions options = {});

  // BatchSource: options().batch_size, and the state as SamplerState's JSON.
  int64_t batch_size() const override;
  std::string state_json() const override;
  void restore_json(const std::string& json) override;

  const Manifest& manifest() const;
  // The directory read, and the registry version it was resolved from ("" for a path).
  const ResolvedDataset& dataset() const;
  const ReaderOptions& options() const;
  // Chunks of token shards hashed so far (each once; 0 for a format 1 or record dataset, and
  // for a remote dataset, whose shards the cache hashes whole before they are read).
  uint64_t chunks_verified() const;
  // A remote dataset's node cache (its stats say what was downloaded); null for a local one.
  const NodeCache* cache() const;
  // Bytes the lookahead thread downloaded ahead of need (remote datasets).
  uint64_t lookahead_bytes() const;
  uint64_t num_samples() const;      // samples per epoch (before the epoch-end policy)
  uint64_t steps_per_epoch() const;  // from the start of an epoch
  // Reads the samples `indices` directly (no prefetch, no state change): for tools and tests.
  Batch read(const std::vector<uint64_t>& indices) const;

  // What the dataset stores, whatever the sampling, for tools that count or compare datasets:
  // its entries are a token dataset's documents or a record dataset's records. size: a
  // document's tokens (its eos included) or a record's payload bytes; hash: the xxHash64 of
  // the document's token ids as little-endian uint32 (whatever their width on disk) or of the
  // record's payload. Read and checked as read() reads (from any thread); entry(i) with
  // i >= num_entries() is InvalidArgument.
  struct Entry {
    uint64_t size = 0;
    uint64_t hash = 0;
  };
  uint64_t num_entries() const;
  Entry entry(uint64_t i) const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::data
