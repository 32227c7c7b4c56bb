// GlobalSampler: each rank's slice of each global batch of the keyed epoch order, and the
// four-field state that resumes it at any world size.

#include "loom/data/sampler.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "data/permutation.h"
#include "loom/error.h"
#include "util/json.h"

namespace loom::data {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxSamples = uint64_t{1} << 63;

// The field of a parsed reader state, checked for presence and type (CorruptData otherwise).
const json& field(const json& object, const char* name) {
  auto it = object.find(name);
  LOOM_CHECK(it != object.end(), CorruptData, "reader state JSON has no \"", name, "\" field");
  return *it;
}

uint64_t unsigned_field(const json& object, const char* name) {
  return util::integer_field<uint64_t>(field(object, name), name, "reader state");
}

std::string string_field(const json& object, const char* name) {
  const json& value = field(object, name);
  LOOM_CHECK(value.is_string(), CorruptData, "reader state field \"", name,
             "\" must be a string, got ", value.dump());
  return value.get<std::string>();
}

}  // namespace

std::string SamplerState::to_json() const {
  json out = json::object();
  out["algorithm"] = Permutation::kAlgorithm;
  out["dataset_version"] = dataset_version;
  out["seed"] = seed;
  out["epoch"] = epoch;
  out["position"] = position;
  if (!dataset.empty()) out["dataset"] = dataset;
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

SamplerState SamplerState::from_json(const std::string& text) {
  json in;
  try {
    in = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw CorruptData(detail::concat("reader state is not valid JSON: ", e.what()));
  }
  LOOM_CHECK(in.is_object(), CorruptData, "reader state JSON must be an object, got ", in.dump());
  const std::string algorithm = string_field(in, "algorithm");
  LOOM_CHECK(algorithm == Permutation::kAlgorithm, InvalidArgument,
             "reader state was saved with sample order \"", algorithm, "\" but this Loom uses \"",
             Permutation::kAlgorithm,
             "\"; its position would point into a different order. Resume with the Loom "
             "version that saved it, or start a new epoch");
  SamplerState state;
  state.dataset_version = string_field(in, "dataset_version");
  state.seed = unsigned_field(in, "seed");
  state.epoch = unsigned_field(in, "epoch");
  state.position = unsigned_field(in, "position");
  if (in.contains("dataset")) state.dataset = string_field(in, "dataset");
  return state;
}

GlobalSampler::GlobalSampler(SamplerOptions options) : options_(std::move(options)) {
  const SamplerOptions& o = options_;
  LOOM_CHECK(o.num_samples >= 1 && o.num_samples <= kMaxSamples, InvalidArgument,
             "sampler num_samples must be in [1, 2^63], got ", o.num_samples);
  LOOM_CHECK(o.per_rank_batch >= 1, InvalidArgument, "sampler per_rank_batch must be >= 1");
  LOOM_CHECK(o.world_size >= 1, InvalidArgument, "sampler world_size must be >= 1, got ",
             o.world_size);
  LOOM_CHECK(o.rank >= 0 && o.rank < o.world_size, InvalidArgument, "sampler rank ", o.rank,
             " is outside [0, ", o.world_size, ")");
  const auto world = static_cast<uint64_t>(o.world_size);
  LOOM_CHECK(o.per_rank_batch <= kMaxSamples / world, InvalidArgument,
             "sampler global batch per_rank_batch * world_size = ", o.per_rank_batch, " * ", world,
             " exceeds 2^63");
  global_batch_ = o.per_rank_batch * world;
  LOOM_CHECK(o.epoch_end != EpochEnd::kDropLast || o.num_samples >= global_batch_, InvalidArgument,
             "with EpochEnd::kDropLast an epoch of ", o.num_samples,
             " samples has no full global batch of ", global_batch_, " (per_rank_batch ",
             o.per_rank_batch, " x world_size ", o.world_size,
             "); use EpochEnd::kPad or a smaller batch");
}

IndexBatch GlobalSampler::next_batch() {
  const uint64_t n = options_.num_samples;
  const uint64_t per_rank = options_.per_rank_batch;
  const Permutation order(n, options_.seed, epoch_);
  // Global positions [first, first + per_rank) of this epoch's order; those at or past n are
  // padding and wrap to the start of the same order. Positions stay below 2^64: position_ < n
  // <= 2^63 and global_batch_ <= 2^63.
  const uint64_t first = position_ + static_cast<uint64_t>(options_.rank) * per_rank;

  IndexBatch batch;
  batch.epoch = epoch_;
  batch.position = position_;
  batch.num_real = first >= n ? 0 : std::min(per_rank, n - first);
  batch.indices.reserve(per_rank);
  for (uint64_t j = 0; j < per_rank; ++j) batch.indices.push_back(order.at((first + j) % n));

  position_ += global_batch_;
  finish_epoch_if_exhausted();
  return batch;
}

void GlobalSampler::finish_epoch_if_exhausted() {
  const uint64_t n = options_.num_samples;
  const bool exhausted = position_ >= n || (options_.epoch_end == EpochEnd::kDropLast &&
                                            n - position_ < global_batch_);
  if (exhausted) {
    ++epoch_;
    position_ = 0;
  }
}

SamplerState GlobalSampler::state() const {
  return SamplerState{options_.dataset_version, options_.seed, epoch_, position_, options_.dataset};
}

void GlobalSampler::restore(const SamplerState& state, RestoreOptions options) {
  LOOM_CHECK(state.seed == options_.seed, InvalidArgument, "reader state has seed ", state.seed,
             " but this sampler was built with seed ", options_.seed,
             "; resuming would continue a different order. Build the sampler with seed ",
             state.seed, " or start a new run");
  const bool same_version = state.dataset_version == options_.dataset_version;
  auto label = [](const std::string& name) { return name.empty() ? "" : " (" + name + ")"; };
  LOOM_CHECK(same_version || options.allow_version_change, InvalidArgument,
             "reader state is for dataset version \"", state.dataset_version, "\"",
             label(state.dataset), " but this sampler reads version \"", options_.dataset_version,
             "\"", label(options_.dataset),
             "; pass allow_version_change to resume across a dataset change");
  LOOM_CHECK(!same_version || state.position <= options_.num_samples, InvalidArgument,
             "reader state position ", state.position, " is beyond the dataset's ",
             options_.num_samples, " samples (dataset version \"", state.dataset_version, "\")");
  epoch_ = state.epoch;
  position_ = state.position;
  finish_epoch_if_exhausted();
}

uint64_t GlobalSampler::steps_per_epoch() const {
  const uint64_t n = options_.num_samples;
  if (options_.epoch_end == EpochEnd::kDropLast) return n / global_batch_;
  return (n - 1) / global_batch_ + 1;
}

}  // namespace loom::data
