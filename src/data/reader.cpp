// data::Reader: shards mapped once, batches gathered from the sampler's indices, a bounded
// prefetch queue filled by one background thread.
#include "loom/data/reader.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "data/chunk_check.h"
#include "data/collate.h"
#include "data/layout.h"
#include "data/manifest.h"
#include "data/shard_format.h"
#include "loom/data/cache.h"
#include "loom/data/registry.h"
#include "loom/error.h"
#include "util/hash.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

// Index of the shard holding global item `i`, given each shard's first item (begins[0] == 0).
size_t shard_of(const std::vector<uint64_t>& begins, uint64_t i) {
  return static_cast<size_t>(std::upper_bound(begins.begin(), begins.end(), i) - begins.begin()) -
         1;
}

template <typename T>
void widen(const uint8_t* src, size_t count, int64_t* out) {
  const T* p = reinterpret_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<int64_t>(p[i]);
}

// One shard ready to read: mapped, with its chunk checks (local token shards) or its cache pin
// (remote shards, verified whole when the cache handed them out).
struct OpenShard {
  NodeCache::Pin pin;
  std::optional<format::TokenShard> tokens;
  std::optional<format::RecordShard> records;
  std::optional<format::ChunkChecker> checker;
};

// Everything a batch is read from. A local dataset's shards are all opened at construction
// and never change, so the prefetch thread and read() use them concurrently without locks.
// A remote dataset's shards are opened when a batch first needs them, through the node cache,
// and closed (unpinned) least recently used first once more than open_budget() bytes are open;
// a shard a batch is reading stays open until the batch is done.
class Source {
 public:
  Source(ResolvedDataset dataset, const ReaderOptions& options)
      : dataset_(std::move(dataset)), options_(options) {
    const std::string location = dataset_.dir.string();
    LOOM_CHECK(options.batch_size >= 1, InvalidArgument, "batch_size must be >= 1, got ",
               options.batch_size);
    if (is_remote(location)) {
      cache_ = std::make_unique<NodeCache>(options.cache, options.remote);
      const std::string url = join_url(location, format::kManifestFile);
      manifest_ = format::parse_manifest_text(cache_->client().get(url), url);
      for (const FileInfo& f : manifest_.tokenizer_files) {
        tokenizer_pins_.push_back(cache_->acquire(remote_file(f.file, f.bytes, f.xxhash64)));
      }
      check_tokenizer_files(cache_->version_dir(manifest_.version), manifest_);
    } else {
      manifest_ = read_manifest(dataset_.dir);
      check_tokenizer_files(dataset_.dir, manifest_);
    }
    const fs::path& dir = dataset_.dir;
    uint64_t begin = 0, doc_begin = 0;
    for (const ShardInfo& info : manifest_.shards) {
      begins_.push_back(begin);
      begin += info.items;
      if (is_tokens()) {
        doc_begins_.push_back(doc_begin);
        doc_begin += info.documents;
      }
    }
    open_.resize(manifest_.shards.size());
    last_use_.resize(manifest_.shards.size());
    if (!cache_) {
      for (size_t s = 0; s < manifest_.shards.size(); ++s) {
        if (options.verify_hashes) check_hash(dir, manifest_.shards[s]);
        open_[s] = open_shard(dir, s, NodeCache::Pin());
      }
      settled_.store(true, std::memory_order_release);
    }
    if (is_tokens()) {
      LOOM_CHECK(options.seq_len >= 1, InvalidArgument,
                 "seq_len must be >= 1 for a token dataset (", location, ")");
      if (options.sampling == TokenSampling::kPacked) {
        LOOM_CHECK(begin > static_cast<uint64_t>(options.seq_len), InvalidArgument, location,
                   " holds ", begin, " tokens, fewer than seq_len + 1 = ", options.seq_len + 1);
        num_samples_ = (begin - 1) / static_cast<uint64_t>(options.seq_len);
      } else {
        num_samples_ = doc_begin;
      }
    } else {
      num_samples_ = begin;
      const bool episodes = manifest_.layout == RecordLayout::kEpisodes;
      LOOM_CHECK(options.episode_sampling == EpisodeSampling::kEpisode || episodes, InvalidArgument,
                 "transition sampling reads episode datasets; ", location, " has the ",
                 to_string(manifest_.layout), " layout");
      if (episodes && options.episode_sampling == EpisodeSampling::kTransition) index_episodes();
    }
    LOOM_CHECK(options.image_channels >= 0 && options.image_channels <= 4, InvalidArgument,
               "image_channels must be 0 (as stored) or 1 to 4, got ", options.image_channels);
    LOOM_CHECK(num_samples_ >= 1, InvalidArgument, location, " holds no samples");
  }

  bool remote() const { return cache_ != nullptr; }
  NodeCache* cache() const { return cache_.get(); }

  // Bytes of remote shards kept open at most (beyond the shards of the batch being read).
  uint64_t open_budget() const {
    if (options_.open_bytes > 0) return options_.open_bytes;
    const uint64_t limit = cache_ ? cache_->options().limit_bytes : 0;
    return limit == 0 ? ~uint64_t{0} : limit / 4;
  }

  // The shards the samples `indices` are read from, sorted, without repeats.
  std::vector<size_t> shards_of(const std::vector<uint64_t>& indices) const {
    std::vector<size_t> out;
    for (uint64_t i : indices) {
      if (!is_tokens()) {
        out.push_back(shard_of(begins_, record_of(i).first));
      } else if (options_.sampling == TokenSampling::kDocument) {
        out.push_back(shard_of(doc_begins_, i));
      } else {
        const uint64_t first = i * static_cast<uint64_t>(options_.seq_len);
        const size_t a = shard_of(begins_, first);
        const size_t b = shard_of(begins_, first + static_cast<uint64_t>(options_.seq_len));
        for (size_t s = a; s <= b; ++s) out.push_back(s);
      }
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

  // Whether every shard is open and stays so: a local dataset, or a remote one whose shards
  // have all been opened with no byte budget to close any. open_ is then constant: reads use
  // it without the mutex, and nothing is left for a lookahead to fetch.
  bool settled() const { return settled_.load(std::memory_order_acquire); }

  // Puts shard `s` of a remote dataset into the node cache without opening it (lookahead).
  // Returns the bytes it had to download (0 when it was cached or open already).
  uint64_t prefetch(size_t s) const {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (open_[s]) return 0;
    }
    const ShardInfo& info = manifest_.shards[s];
    bool downloaded = false;
    cache_->acquire(remote_file(info.file, info.bytes, info.xxhash64), &downloaded);
    return downloaded ? info.bytes : 0;
  }

  const ResolvedDataset& dataset() const { return dataset_; }
  const Manifest& manifest() const { return manifest_; }
  uint64_t num_samples() const { return num_samples_; }
  uint64_t chunks_verified() const {
    uint64_t n = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& shard : open_) {
      if (shard && shard->checker) n += shard->checker->chunks_verified();
    }
    return n;
  }

  uint64_t num_entries() const {
    return is_tokens() ? manifest_.total_documents() : manifest_.total_items();
  }

  Reader::Entry entry(uint64_t i) const {
    LOOM_CHECK(i < num_entries(), InvalidArgument, "entry ", i, " of ", dataset_.dir.string(),
               ", which holds ", num_entries(), is_tokens() ? " documents" : " records");
    const std::vector<uint64_t>& starts = is_tokens() ? doc_begins_ : begins_;
    const size_t s = shard_of(starts, i);
    const uint64_t local = i - starts[s];
    Held held(*this);
    if (!settled()) held.hold(s);
    const OpenShard& open = held[s];
    if (!is_tokens()) {
      const auto [payload, size] = open.records->payload(local);
      return {size, util::xxh64(payload, size)};
    }
    if (open.checker) open.checker->check(open.tokens->index_offset() + 8 * local, 16);
    const auto [begin, end] = open.tokens->document(local);
    std::vector<int64_t> ids(static_cast<size_t>(end - begin));
    copy_tokens(begins_[s] + begin, ids.size(), held, ids.data());
    std::vector<uint8_t> bytes(4 * ids.size());
    for (size_t k = 0; k < ids.size(); ++k) {
      for (int b = 0; b < 4; ++b) bytes[4 * k + b] = static_cast<uint8_t>(ids[k] >> (8 * b));
    }
    return {end - begin, util::xxh64(bytes.data(), bytes.size())};
  }

  Batch read(const std::vector<uint64_t>& indices) const {
    Batch batch;
    batch.indices = indices;
    batch.num_real = static_cast<int64_t>(indices.size());
    Held held(*this);
    if (!settled()) {
      for (size_t s : shards_of(indices)) held.hold(s);
    }
    if (is_tokens()) {
      read_tokens(indices, held, batch);
    } else {
      read_records(indices, held, batch);
    }
    return batch;
  }

 private:
  // The shards one batch reads, kept open while it reads them.
  class Held {
   public:
    explicit Held(const Source& source) : source_(source) {}
    void hold(size_t s) { held_.emplace_back(s, source_.open(s)); }
    const OpenShard& operator[](size_t s) const {
      if (source_.settled()) return *source_.open_[s];  // constant: no lock, no copy
      for (const auto& [i, shard] : held_) {
        if (i == s) return *shard;
      }
      throw std::logic_error("data::Reader: a shard the batch did not hold was read");
    }

   private:
    const Source& source_;
    std::vector<std::pair<size_t, std::shared_ptr<const OpenShard>>> held_;
  };

  RemoteFile remote_file(const std::string& name, uint64_t bytes, uint64_t hash) const {
    return {join_url(dataset_.dir.string(), name), manifest_.version, name, bytes, hash};
  }

  std::shared_ptr<const OpenShard> open_shard(const fs::path& dir, size_t s,
                                              NodeCache::Pin pin) const {
    const ShardInfo& info = manifest_.shards[s];
    auto shard = std::make_shared<OpenShard>();
    shard->pin = std::move(pin);
    if (is_tokens()) {
      shard->tokens.emplace(dir, info, format::token_bytes_for(manifest_.vocab_size));
      // A cached remote shard was hashed whole before the cache handed it out.
      if (options_.verify_chunks && !remote()) {
        const util::MappedFile& file = shard->tokens->file();
        shard->checker.emplace(file.data(), file.size(), manifest_.chunk_bytes, info.chunk_hashes,
                               file.path());
      }
    } else {
      shard->records.emplace(dir, info);
    }
    return shard;
  }

  // Shard `s`, opened (and for a remote dataset fetched into the node cache) if it is not.
  std::shared_ptr<const OpenShard> open(size_t s) const {
    if (settled()) return open_[s];
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (open_[s]) {
        last_use_[s] = ++clock_;
        return open_[s];
      }
    }
    const ShardInfo& info = manifest_.shards[s];
    NodeCache::Pin pin = cache_->acquire(remote_file(info.file, info.bytes, info.xxhash64));
    std::shared_ptr<const OpenShard> shard =
        open_shard(cache_->version_dir(manifest_.version), s, std::move(pin));
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_[s]) {
      open_[s] = std::move(shard);
      open_bytes_ += info.bytes;
      if (++opened_ == open_.size() && open_budget() == ~uint64_t{0}) {
        settled_.store(true, std::memory_order_release);
      }
    }
    last_use_[s] = ++clock_;
    close_unused(s);
    return open_[s];
  }

  // Closes the least recently used open shards that no batch is reading until the open bytes
  // fit the budget; never `keep`. Called with mutex_ held.
  void close_unused(size_t keep) const {
    const uint64_t budget = open_budget();
    while (open_bytes_ > budget) {
      size_t victim = open_.size();
      for (size_t s = 0; s < open_.size(); ++s) {
        if (s == keep || !open_[s] || open_[s].use_count() > 1) continue;
        if (victim == open_.size() || last_use_[s] < last_use_[victim]) victim = s;
      }
      if (victim == open_.size()) return;
      open_[victim].reset();
      --opened_;
      open_bytes_ -= manifest_.shards[victim].bytes;
    }
  }

  bool is_tokens() const { return manifest_.kind == DatasetKind::kTokens; }

  static void check_hash(const fs::path& dir, const ShardInfo& info) {
    util::MappedFile file(dir / info.file);
    const uint64_t hash = util::xxh64(file.data(), file.size());
    LOOM_CHECK(hash == info.xxhash64, CorruptData, "shard ", file.path().string(), " has xxHash64 ",
               util::hash_hex(hash), " but the manifest says ", util::hash_hex(info.xxhash64),
               ": the file changed after the build; restore or rebuild it");
  }

  // Copies `count` tokens of the global stream from `offset` into out, across shards.
  void copy_tokens(uint64_t offset, size_t count, const Held& held, int64_t* out) const {
    while (count > 0) {
      const size_t s = shard_of(begins_, offset);
      const OpenShard& open = held[s];
      const format::TokenShard& shard = *open.tokens;
      const uint64_t local = offset - begins_[s];
      const size_t n = static_cast<size_t>(std::min<uint64_t>(count, shard.num_tokens() - local));
      const uint8_t* src = shard.tokens() + local * shard.token_bytes();
      if (open.checker) {
        open.checker->check(sizeof(format::TokenHeader) + local * shard.token_bytes(),
                            n * shard.token_bytes());
      }
      if (shard.token_bytes() == 2) {
        widen<uint16_t>(src, n, out);
      } else {
        widen<uint32_t>(src, n, out);
      }
      out += n;
      offset += n;
      count -= n;
    }
  }

  void read_tokens(const std::vector<uint64_t>& indices, const Held& held, Batch& batch) const {
    const int64_t rows = static_cast<int64_t>(indices.size());
    const int64_t width = options_.seq_len + 1;
    at::Tensor tokens = at::empty({rows, width}, at::kLong);
    int64_t* out = tokens.data_ptr<int64_t>();
    if (options_.sampling == TokenSampling::kPacked) {
      for (int64_t r = 0; r < rows; ++r) {
        copy_tokens(indices[r] * static_cast<uint64_t>(options_.seq_len), width, held,
                    out + r * width);
      }
    } else {
      at::Tensor mask = at::zeros({rows, width}, at::kBool);
      bool* m = mask.data_ptr<bool>();
      for (int64_t r = 0; r < rows; ++r) {
        const size_t s = shard_of(doc_begins_, indices[r]);
        const uint64_t d = indices[r] - doc_begins_[s];
        const OpenShard& open = held[s];
        if (open.checker) open.checker->check(open.tokens->index_offset() + 8 * d, 16);
        const auto [begin, end] = open.tokens->document(d);
        const int64_t n = std::min<int64_t>(width, static_cast<int64_t>(end - begin));
        copy_tokens(begins_[s] + begin, static_cast<size_t>(n), held, out + r * width);
        std::fill(out + r * width + n, out + (r + 1) * width, options_.pad_id);
        std::fill(m + r * width, m + r * width + n, true);
      }
      batch.tensors["mask"] = mask;
    }
    batch.tensors["tokens"] = tokens;
  }

  // The record and step of sample i of a record dataset: a transition (episode_steps_ set) or
  // a whole record (step -1).
  std::pair<uint64_t, int64_t> record_of(uint64_t i) const {
    if (episode_steps_.empty()) return {i, -1};
    const size_t e = shard_of(episode_steps_, i);
    return {e, static_cast<int64_t>(i - episode_steps_[e])};
  }

  void read_records(const std::vector<uint64_t>& indices, const Held& held, Batch& batch) const {
    const auto& schema = manifest_.schema;
    const size_t width = schema.size();
    std::vector<format::FieldView> all(indices.size() * width);
    std::vector<collate::Row> rows(indices.size());
    std::vector<std::pair<const format::RecordShard*, uint64_t>> where(indices.size());
    for (size_t r = 0; r < indices.size(); ++r) {
      const auto [record, step] = record_of(indices[r]);
      const size_t s = shard_of(begins_, record);
      const uint64_t local = record - begins_[s];
      const format::RecordShard& shard = *held[s].records;
      decode(shard, local, all.data() + r * width);
      rows[r] = {all.data() + r * width, step, record};
      where[r] = {&shard, local};
    }
    collate::records(
        manifest_, options_, rows,
        [&](size_t r) { return record_name(*where[r].first, where[r].second); }, batch);
  }

  static std::string record_name(const format::RecordShard& shard, uint64_t local) {
    return detail::concat("record ", local, " of shard ", shard.file().path().string(),
                          " (byte offset ", shard.offset(local), ")");
  }

  // Record `local` of `shard`, checked against its checksum and decoded into views[0, fields).
  void decode(const format::RecordShard& shard, uint64_t local, format::FieldView* views) const {
    auto [p, n] = shard.payload(local);
    const std::string bad = format::decode_record(manifest_.schema, p, n, views);
    LOOM_CHECK(bad.empty(), CorruptData, record_name(shard, local), " is malformed: ", bad,
               "; run `loom data verify`");
  }

  // Transition sampling: the first step of every episode (record), from every record's length.
  void index_episodes() {
    const layout::EpisodeFields f = layout::episode_fields(manifest_.schema);
    std::vector<format::FieldView> views(manifest_.schema.size());
    uint64_t steps = 0;
    for (size_t s = 0; s < manifest_.shards.size(); ++s) {
      Held held(*this);
      if (!settled()) held.hold(s);
      const format::RecordShard& shard = *held[s].records;
      for (uint64_t i = 0; i < shard.num_records(); ++i) {
        decode(shard, i, views.data());
        const std::string bad =
            layout::check_record(manifest_.layout, manifest_.schema, views.data());
        LOOM_CHECK(bad.empty(), CorruptData, record_name(shard, i), ": ", bad,
                   "; run `loom data verify`");
        episode_steps_.push_back(steps);
        steps += static_cast<uint64_t>(layout::episode_length(f, views.data()));
      }
    }
    num_samples_ = steps;
  }

  ResolvedDataset dataset_;
  Manifest manifest_;
  ReaderOptions options_;
  std::vector<uint64_t> begins_;      // first global item (token or record) of each shard
  std::vector<uint64_t> doc_begins_;  // token datasets: first global document of each shard
  // Transition sampling: the first global step of each episode (record).
  std::vector<uint64_t> episode_steps_;
  uint64_t num_samples_ = 0;
  // Remote datasets: the node cache, and the tokenizer files pinned for the reader's life.
  std::unique_ptr<NodeCache> cache_;
  std::vector<NodeCache::Pin> tokenizer_pins_;
  // Each shard when open. Local datasets: all, constant after construction. Remote: guarded
  // by mutex_, with each open shard's last use (a tick of clock_) and the bytes open.
  mutable std::mutex mutex_;
  mutable std::vector<std::shared_ptr<const OpenShard>> open_;
  mutable std::vector<uint64_t> last_use_;
  mutable uint64_t clock_ = 0;
  mutable uint64_t open_bytes_ = 0;
  mutable size_t opened_ = 0;  // shards open
  mutable std::atomic<bool> settled_{false};
};

}  // namespace

const at::Tensor& Batch::operator[](const std::string& name) const {
  auto it = tensors.find(name);
  if (it != tensors.end()) return it->second;
  std::string known;
  for (const auto& [key, value] : tensors) known += (known.empty() ? "" : ", ") + key;
  throw InvalidArgument(detail::concat("the batch has no tensor '", name, "'; it has: ", known));
}

struct Reader::Impl {
  // A prepared batch and the sampler state after it (or the error preparing it raised).
  struct Item {
    Batch batch;
    SamplerState state;
    std::exception_ptr error;
  };

  // Constant after construction.
  ReaderOptions options;
  Source source;

  // Owned by the consumer thread.
  SamplerState consumed;

  // The sampler belongs to the prefetch thread while it runs, to the consumer otherwise.
  GlobalSampler sampler;

  // State below is protected by mutex. Each side signals the other only when it waits, so a
  // full pipeline hands batches over without system calls.
  std::mutex mutex;
  std::condition_variable not_empty;  // the consumer waits on it
  std::condition_variable not_full;   // the prefetch thread waits on it
  std::deque<Item> queue;
  std::atomic<size_t> queued{0};  // queue.size(), readable without the mutex (the spin)
  bool consumer_waiting = false;
  bool producer_waiting = false;
  bool stop = false;
  std::thread prefetcher;

  // Remote datasets: the lookahead thread fetches the shards of the next steps into the node
  // cache. It walks its own sampler from the consumed state; steps_taken counts next() calls
  // since it started (guarded by mutex, like lookahead_stop).
  std::thread lookahead;
  std::condition_variable lookahead_wake;
  bool lookahead_stop = false;
  uint64_t steps_taken = 0;
  std::atomic<uint64_t> lookahead_bytes{0};

  Impl(const fs::path& dataset, ReaderOptions opts)
      : options(opts),
        source(resolve_dataset(dataset.string(), opts.registry, opts.remote), opts),
        sampler(sampler_options(opts, source)) {
    LOOM_CHECK(options.prefetch >= 0, InvalidArgument, "prefetch must be >= 0, got ",
               options.prefetch);
    LOOM_CHECK(options.lookahead_steps >= 0, InvalidArgument, "lookahead_steps must be >= 0, got ",
               options.lookahead_steps);
    consumed = sampler.state();
  }

  static SamplerOptions sampler_options(const ReaderOptions& o, const Source& source) {
    SamplerOptions s;
    s.num_samples = source.num_samples();
    s.seed = o.seed;
    s.per_rank_batch = static_cast<uint64_t>(o.batch_size);
    s.rank = o.rank;
    s.world_size = o.world_size;
    s.epoch_end = o.epoch_end;
    s.dataset_version = source.manifest().version;
    s.dataset = source.dataset().ref;
    return s;
  }

  Item produce() {
    Item item;
    try {
      IndexBatch ib = sampler.next_batch();
      item.batch = source.read(ib.indices);
      item.batch.num_real = static_cast<int64_t>(ib.num_real);
      item.batch.epoch = ib.epoch;
      item.state = sampler.state();
    } catch (...) {
      item.error = std::current_exception();
    }
    return item;
  }

  void start() {
    if (options.prefetch == 0 || prefetcher.joinable()) return;
    stop = false;
    prefetcher = std::thread([this] { prefetch_loop(); });
  }

  void start_lookahead() {
    if (!source.remote() || source.settled() || options.lookahead_steps == 0 ||
        lookahead.joinable()) {
      return;
    }
    GlobalSampler ahead(sampler_options(options, source));
    ahead.restore(consumed);
    {
      std::lock_guard<std::mutex> lock(mutex);
      lookahead_stop = false;
      steps_taken = 0;
    }
    lookahead = std::thread([this, ahead]() mutable { lookahead_loop(ahead); });
  }

  // Fetches, in the order they will be read, the shards of the steps up to lookahead_steps
  // ahead of the consumer, while what it fetched for steps not yet taken fits half the limit.
  void lookahead_loop(GlobalSampler ahead) {
    const uint64_t limit = source.cache()->options().limit_bytes;
    const uint64_t budget = limit == 0 ? ~uint64_t{0} : limit / 2;
    std::deque<uint64_t> window;  // bytes fetched for each step in [steps_taken, step)
    uint64_t window_bytes = 0;
    for (uint64_t step = 0;; ++step) {
      if (source.settled()) return;  // nothing is left to fetch
      {
        std::unique_lock<std::mutex> lock(mutex);
        lookahead_wake.wait(lock, [&] {
          while (!window.empty() && window.size() > step - std::min(step, steps_taken)) {
            window_bytes -= window.front();
            window.pop_front();
          }
          return lookahead_stop ||
                 (step < steps_taken + static_cast<uint64_t>(options.lookahead_steps) &&
                  window_bytes <= budget);
        });
        if (lookahead_stop) return;
      }
      uint64_t fetched = 0;
      try {
        for (size_t s : source.shards_of(ahead.next_batch().indices)) {
          fetched += source.prefetch(s);
          std::lock_guard<std::mutex> lock(mutex);
          if (lookahead_stop) return;
        }
      } catch (const std::exception&) {
        return;  // the batch that needs the shard raises the error when it reads it
      }
      lookahead_bytes.fetch_add(fetched, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(mutex);
      window.push_back(fetched);
      window_bytes += fetched;
    }
  }

  // The consumer took a step: the lookahead may go further. It is woken every quarter of its
  // horizon, not every step, so that a fast consumer does not pay a thread switch per batch.
  void took_step() {
    if (!lookahead.joinable()) return;
    const uint64_t every = std::max(1, options.lookahead_steps / 4);
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mutex);
      wake = ++steps_taken % every == 0;
    }
    if (wake) lookahead_wake.notify_one();
  }

  void halt() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
      lookahead_stop = true;
    }
    not_full.notify_all();
    lookahead_wake.notify_all();
    if (prefetcher.joinable()) prefetcher.join();
    if (lookahead.joinable()) lookahead.join();
    queue.clear();
    queued.store(0);
  }

  void prefetch_loop() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        producer_waiting = true;
        not_full.wait(lock,
                      [&] { return stop || queue.size() < static_cast<size_t>(options.prefetch); });
        producer_waiting = false;
        if (stop) return;
      }
      Item item = produce();
      const bool failed = item.error != nullptr;
      bool wake;
      {
        std::lock_guard<std::mutex> lock(mutex);
        queue.push_back(std::move(item));
        queued.store(queue.size(), std::memory_order_release);
        wake = consumer_waiting;
      }
      if (wake) not_empty.notify_one();
      if (failed) return;  // the consumer rethrows; restore() or a new reader starts over
    }
  }

  Item take() {
    if (options.prefetch == 0) return produce();
    start();
    // A batch is often only microseconds away: yield for up to kSpin before sleeping on the
    // condition variable, whose wake-up costs more than preparing a small batch.
    constexpr auto kSpin = std::chrono::microseconds(100);
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (queued.load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mutex);
    consumer_waiting = true;
    not_empty.wait(lock, [&] { return !queue.empty(); });
    consumer_waiting = false;
    Item item = std::move(queue.front());
    queue.pop_front();
    queued.store(queue.size(), std::memory_order_release);
    const bool wake = producer_waiting;
    lock.unlock();
    if (wake) not_full.notify_one();
    return item;
  }
};

Reader::Reader(const fs::path& dir, ReaderOptions options)
    : impl_(std::make_unique<Impl>(dir, options)) {}

Reader::~Reader() { impl_->halt(); }

Batch Reader::next() {
  impl_->start_lookahead();
  Impl::Item item = impl_->take();
  if (item.error) {
    // The failed batch is not consumed: halt so a later next() retries it from `consumed`.
    impl_->halt();
    impl_->sampler.restore(impl_->consumed);
    std::rethrow_exception(item.error);
  }
  impl_->consumed = item.state;
  impl_->took_step();
  return std::move(item.batch);
}

SamplerState Reader::state() const { return impl_->consumed; }

void Reader::restore(const SamplerState& saved, RestoreOptions options) {
  impl_->halt();
  // A state of the version these shards had before a migration moved it is of this data.
  SamplerState state = saved;
  const Manifest& m = impl_->source.manifest();
  if (!m.previous_version.empty() && state.dataset_version == m.previous_version) {
    state.dataset_version = m.version;
  }
  try {
    impl_->sampler.restore(state, options);
  } catch (...) {
    impl_->sampler.restore(impl_->consumed);
    throw;
  }
  impl_->consumed = impl_->sampler.state();
}

const Manifest& Reader::manifest() const { return impl_->source.manifest(); }
const ResolvedDataset& Reader::dataset() const { return impl_->source.dataset(); }
uint64_t Reader::chunks_verified() const { return impl_->source.chunks_verified(); }
const NodeCache* Reader::cache() const { return impl_->source.cache(); }
uint64_t Reader::lookahead_bytes() const { return impl_->lookahead_bytes.load(); }
const ReaderOptions& Reader::options() const { return impl_->options; }
uint64_t Reader::num_samples() const { return impl_->source.num_samples(); }
uint64_t Reader::steps_per_epoch() const { return impl_->sampler.steps_per_epoch(); }
Batch Reader::read(const std::vector<uint64_t>& indices) const {
  return impl_->source.read(indices);
}
uint64_t Reader::num_entries() const { return impl_->source.num_entries(); }
Reader::Entry Reader::entry(uint64_t i) const { return impl_->source.entry(i); }

int64_t Reader::batch_size() const { return impl_->options.batch_size; }
std::string Reader::state_json() const { return state().to_json(); }
void Reader::restore_json(const std::string& json) { restore(SamplerState::from_json(json)); }

}  // namespace loom::data
