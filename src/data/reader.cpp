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
#include <thread>

#include "data/chunk_check.h"
#include "data/shard_format.h"
#include "loom/data/registry.h"
#include "loom/error.h"
#include "util/hash.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

at::ScalarType scalar_type(const std::string& dtype) {
  static const std::map<std::string, at::ScalarType> types = {
      {"uint8", at::kByte},        {"int8", at::kChar},     {"int16", at::kShort},
      {"int32", at::kInt},         {"int64", at::kLong},    {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"float32", at::kFloat}, {"float64", at::kDouble},
      {"bool", at::kBool}};
  return types.at(dtype);
}

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

// Everything a batch is read from; immutable after construction, so the prefetch thread and
// read() may use it concurrently.
class Source {
 public:
  Source(ResolvedDataset dataset, const ReaderOptions& options)
      : dataset_(std::move(dataset)), manifest_(read_manifest(dataset_.dir)), options_(options) {
    const fs::path& dir = dataset_.dir;
    LOOM_CHECK(options.batch_size >= 1, InvalidArgument, "batch_size must be >= 1, got ",
               options.batch_size);
    check_tokenizer_files(dir, manifest_);
    uint64_t begin = 0, doc_begin = 0;
    for (const ShardInfo& info : manifest_.shards) {
      if (options.verify_hashes) check_hash(dir, info);
      begins_.push_back(begin);
      begin += info.items;
      if (is_tokens()) {
        doc_begins_.push_back(doc_begin);
        doc_begin += info.documents;
        tokens_.emplace_back(dir, info, format::token_bytes_for(manifest_.vocab_size));
      } else {
        records_.emplace_back(dir, info);
      }
    }
    for (size_t s = 0; s < tokens_.size() && options.verify_chunks; ++s) {
      const util::MappedFile& file = tokens_[s].file();
      checkers_.emplace_back(file.data(), file.size(), manifest_.chunk_bytes,
                             manifest_.shards[s].chunk_hashes, file.path());
    }
    if (is_tokens()) {
      LOOM_CHECK(options.seq_len >= 1, InvalidArgument,
                 "seq_len must be >= 1 for a token dataset (", dir.string(), ")");
      if (options.sampling == TokenSampling::kPacked) {
        LOOM_CHECK(begin > static_cast<uint64_t>(options.seq_len), InvalidArgument, dir.string(),
                   " holds ", begin, " tokens, fewer than seq_len + 1 = ", options.seq_len + 1);
        num_samples_ = (begin - 1) / static_cast<uint64_t>(options.seq_len);
      } else {
        num_samples_ = doc_begin;
      }
    } else {
      num_samples_ = begin;
    }
    LOOM_CHECK(num_samples_ >= 1, InvalidArgument, dir.string(), " holds no samples");
  }

  const ResolvedDataset& dataset() const { return dataset_; }
  const Manifest& manifest() const { return manifest_; }
  uint64_t num_samples() const { return num_samples_; }
  uint64_t chunks_verified() const {
    uint64_t n = 0;
    for (const format::ChunkChecker& c : checkers_) n += c.chunks_verified();
    return n;
  }

  Batch read(const std::vector<uint64_t>& indices) const {
    Batch batch;
    batch.indices = indices;
    batch.num_real = static_cast<int64_t>(indices.size());
    if (is_tokens()) {
      read_tokens(indices, batch);
    } else {
      read_records(indices, batch);
    }
    return batch;
  }

 private:
  bool is_tokens() const { return manifest_.kind == DatasetKind::kTokens; }

  static void check_hash(const fs::path& dir, const ShardInfo& info) {
    util::MappedFile file(dir / info.file);
    const uint64_t hash = util::xxh64(file.data(), file.size());
    LOOM_CHECK(hash == info.xxhash64, CorruptData, "shard ", file.path().string(), " has xxHash64 ",
               util::hash_hex(hash), " but the manifest says ", util::hash_hex(info.xxhash64),
               ": the file changed after the build; restore or rebuild it");
  }

  // Copies `count` tokens of the global stream from `offset` into out, across shards.
  void copy_tokens(uint64_t offset, size_t count, int64_t* out) const {
    while (count > 0) {
      const size_t s = shard_of(begins_, offset);
      const format::TokenShard& shard = tokens_[s];
      const uint64_t local = offset - begins_[s];
      const size_t n = static_cast<size_t>(std::min<uint64_t>(count, shard.num_tokens() - local));
      const uint8_t* src = shard.tokens() + local * shard.token_bytes();
      if (!checkers_.empty()) {
        checkers_[s].check(sizeof(format::TokenHeader) + local * shard.token_bytes(),
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

  void read_tokens(const std::vector<uint64_t>& indices, Batch& batch) const {
    const int64_t rows = static_cast<int64_t>(indices.size());
    const int64_t width = options_.seq_len + 1;
    at::Tensor tokens = at::empty({rows, width}, at::kLong);
    int64_t* out = tokens.data_ptr<int64_t>();
    if (options_.sampling == TokenSampling::kPacked) {
      for (int64_t r = 0; r < rows; ++r) {
        copy_tokens(indices[r] * static_cast<uint64_t>(options_.seq_len), width, out + r * width);
      }
    } else {
      at::Tensor mask = at::zeros({rows, width}, at::kBool);
      bool* m = mask.data_ptr<bool>();
      for (int64_t r = 0; r < rows; ++r) {
        const size_t s = shard_of(doc_begins_, indices[r]);
        const uint64_t d = indices[r] - doc_begins_[s];
        if (!checkers_.empty()) checkers_[s].check(tokens_[s].index_offset() + 8 * d, 16);
        const uint64_t begin = tokens_[s].doc_offset(d), end = tokens_[s].doc_offset(d + 1);
        const int64_t n = std::min<int64_t>(width, static_cast<int64_t>(end - begin));
        copy_tokens(begins_[s] + begin, static_cast<size_t>(n), out + r * width);
        std::fill(out + r * width + n, out + (r + 1) * width, options_.pad_id);
        std::fill(m + r * width, m + r * width + n, true);
      }
      batch.tensors["mask"] = mask;
    }
    batch.tensors["tokens"] = tokens;
  }

  void read_records(const std::vector<uint64_t>& indices, Batch& batch) const {
    const auto& schema = manifest_.schema;
    const int64_t rows = static_cast<int64_t>(indices.size());
    const size_t width = schema.size();
    std::vector<format::FieldView> all(indices.size() * width);
    auto views = [&](size_t r) { return all.data() + r * width; };
    for (size_t r = 0; r < indices.size(); ++r) {
      const size_t s = shard_of(begins_, indices[r]);
      const uint64_t local = indices[r] - begins_[s];
      auto [p, n] = records_[s].payload(local);
      const std::string bad = format::decode_record(schema, p, n, views(r));
      LOOM_CHECK(bad.empty(), CorruptData, "record ", local, " of shard ",
                 records_[s].file().path().string(), " (byte offset ", records_[s].offset(local),
                 ") is malformed: ", bad, "; run `loom data verify`");
    }
    for (size_t f = 0; f < schema.size(); ++f) {
      const Field& field = schema[f];
      switch (field.type) {
        case FieldType::kInt:
        case FieldType::kFloat: {
          const bool is_int = field.type == FieldType::kInt;
          at::Tensor t = at::empty({rows}, is_int ? at::kLong : at::kDouble);
          if (is_int) {
            int64_t* out = t.data_ptr<int64_t>();
            for (int64_t r = 0; r < rows; ++r) out[r] = views(r)[f].integer;
          } else {
            double* out = t.data_ptr<double>();
            for (int64_t r = 0; r < rows; ++r) out[r] = views(r)[f].real;
          }
          batch.tensors[field.name] = t;
          break;
        }
        case FieldType::kText:
        case FieldType::kBytes: {
          auto& out = batch.strings[field.name];
          for (int64_t r = 0; r < rows; ++r) {
            out.emplace_back(reinterpret_cast<const char*>(views(r)[f].data), views(r)[f].size);
          }
          break;
        }
        case FieldType::kTensor: {
          const format::FieldView& first = views(0)[f];
          std::vector<int64_t> full{rows};
          full.insert(full.end(), first.dims, first.dims + first.ndim);
          at::Tensor t = at::empty(full, scalar_type(field.dtype));
          auto* out = static_cast<uint8_t*>(t.data_ptr());
          const size_t row_bytes = views(0)[f].size;
          for (int64_t r = 0; r < rows; ++r) {
            LOOM_CHECK(views(r)[f].same_shape(first), InvalidArgument, "tensor field '", field.name,
                       "' has different shapes within one batch (samples ", indices[0], " and ",
                       indices[r], "); only equal shapes can be stacked");
            std::memcpy(out + r * row_bytes, views(r)[f].data, row_bytes);
          }
          batch.tensors[field.name] = t;
          break;
        }
      }
    }
  }

  ResolvedDataset dataset_;
  Manifest manifest_;
  ReaderOptions options_;
  std::vector<uint64_t> begins_;      // first global item (token or record) of each shard
  std::vector<uint64_t> doc_begins_;  // token datasets: first global document of each shard
  std::vector<format::TokenShard> tokens_;
  std::vector<format::RecordShard> records_;
  // Token shards' chunk checks (empty when options_.verify_chunks is off). Record shards need
  // none: every record carries its own checksum.
  std::vector<format::ChunkChecker> checkers_;
  uint64_t num_samples_ = 0;
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

  Impl(const fs::path& dataset, ReaderOptions opts)
      : options(opts),
        source(resolve_dataset(dataset.string(), opts.registry), opts),
        sampler(sampler_options(opts, source)) {
    LOOM_CHECK(options.prefetch >= 0, InvalidArgument, "prefetch must be >= 0, got ",
               options.prefetch);
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

  void halt() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    not_full.notify_all();
    if (prefetcher.joinable()) prefetcher.join();
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
  Impl::Item item = impl_->take();
  if (item.error) {
    // The failed batch is not consumed: halt so a later next() retries it from `consumed`.
    impl_->halt();
    impl_->sampler.restore(impl_->consumed);
    std::rethrow_exception(item.error);
  }
  impl_->consumed = item.state;
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
const ReaderOptions& Reader::options() const { return impl_->options; }
uint64_t Reader::num_samples() const { return impl_->source.num_samples(); }
uint64_t Reader::steps_per_epoch() const { return impl_->sampler.steps_per_epoch(); }
Batch Reader::read(const std::vector<uint64_t>& indices) const {
  return impl_->source.read(indices);
}

int64_t Reader::batch_size() const { return impl_->options.batch_size; }
std::string Reader::state_json() const { return state().to_json(); }
void Reader::restore_json(const std::string& json) { restore(SamplerState::from_json(json)); }

}  // namespace loom::data
