// data::Mixture: keyed draws of a source per sample slot, each source's samples in its own
// keyed permutation, rows read through one Reader per source and stacked (mixture.h).
#include "loom/data/mixture.h"

#include <ATen/ATen.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "data/permutation.h"
#include "loom/error.h"
#include "util/dtype.h"
#include "util/json.h"
#include "util/mix.h"

namespace loom::data {
namespace {

// Keep the mixture's streams apart from each other and from the single-dataset order.
constexpr uint64_t kDrawTag = 0x6D69782D64726177ull;   // "mix-draw"
constexpr uint64_t kOrderTag = 0x6D69782D6F726472ull;  // "mix-ordr"
constexpr const char* kAlgorithm = "mixture-v1";

// What a source's batches look like: tensor names with dtype and per-row shape, string names.
std::string layout_of(const Batch& batch) {
  std::string layout;
  for (const auto& [name, t] : batch.tensors) {
    layout += name + ":" + util::dtype_name(t.scalar_type()) + "[";
    for (int64_t d = 1; d < t.dim(); ++d) layout += (d > 1 ? "," : "") + std::to_string(t.size(d));
    layout += "] ";
  }
  for (const auto& item : batch.strings) layout += item.first + ":string ";
  return layout;
}

}  // namespace

struct Mixture::Impl {
  // Constant after construction.
  std::vector<MixtureSource> sources;
  MixtureOptions options;
  std::vector<std::unique_ptr<Reader>> readers;
  std::vector<uint64_t> sizes;        // samples per epoch of each source
  std::vector<uint64_t> order_seeds;  // each source's permutation seed
  bool all_stop = true;
  // The position: slots taken by all ranks, and draws per source.
  uint64_t slots = 0;
  std::vector<uint64_t> drawn;
  // The permutation of each source's last epoch drawn from, kept between draws.
  mutable std::vector<std::optional<Permutation>> orders;
  mutable std::vector<uint64_t> order_epochs;

  uint64_t global_batch() const {
    return static_cast<uint64_t>(options.batch_size) * static_cast<uint64_t>(options.world_size);
  }

  bool active(size_t s, const std::vector<uint64_t>& counts) const {
    return sources[s].epochs == SourceEpochs::kRepeat || counts[s] < sizes[s];
  }

  // The source of slot `slot`, given the draws so far: a keyed uniform against the weights of
  // the sources still in the mix.
  size_t draw(uint64_t slot, const std::vector<uint64_t>& counts) const {
    double total = 0;
    for (size_t s = 0; s < sources.size(); ++s) {
      if (active(s, counts)) total += sources[s].weight;
    }
    double u = util::unit_interval(util::splitmix64(options.seed ^ kDrawTag, slot)) * total;
    size_t last = 0;
    for (size_t s = 0; s < sources.size(); ++s) {
      if (!active(s, counts)) continue;
      if (u < sources[s].weight) return s;
      u -= sources[s].weight;
      last = s;
    }
    return last;  // rounding left u a hair above the last weight
  }

  // Source s's sample for its draw number `n`: position n % size of epoch n / size's order.
  uint64_t sample_of(size_t s, uint64_t n) const {
    const uint64_t epoch = n / sizes[s];
    if (!orders[s] || order_epochs[s] != epoch) {
      orders[s].emplace(sizes[s], order_seeds[s], epoch);
      order_epochs[s] = epoch;
    }
    return orders[s]->at(n % sizes[s]);
  }

  bool exhausted() const {
    if (!all_stop) return false;
    uint64_t left = 0;
    for (size_t s = 0; s < sources.size(); ++s) left += sizes[s] - std::min(drawn[s], sizes[s]);
    return left < global_batch();
  }

  void check_not_exhausted() const {
    LOOM_CHECK(!exhausted(), InvalidArgument, "Mixture: exhausted after ", slots,
               " samples: every source is SourceEpochs::kStop and fewer than a global batch (",
               global_batch(), ") remain; use kRepeat for sources that may start again");
  }

  // The draws of `steps` global batches, without reading their samples.
  void skip(uint64_t steps) {
    for (uint64_t step = 0; step < steps; ++step) {
      check_not_exhausted();
      for (uint64_t j = 0; j < global_batch(); ++j) ++drawn[draw(slots + j, drawn)];
      slots += global_batch();
    }
  }

  Batch next() {
    check_not_exhausted();
    const uint64_t b = static_cast<uint64_t>(options.batch_size);
    const uint64_t first = static_cast<uint64_t>(options.rank) * b;
    std::vector<uint64_t> counts = drawn;
    std::vector<std::vector<uint64_t>> indices(sources.size());  // per source, its rows'
    std::vector<std::vector<int64_t>> rows(sources.size());      // and where they go
    Batch out;
    out.indices.resize(b);
    out.sources.resize(b);
    for (uint64_t j = 0; j < global_batch(); ++j) {
      const size_t s = draw(slots + j, counts);
      const uint64_t index = sample_of(s, counts[s]++);
      if (j < first || j >= first + b) continue;
      indices[s].push_back(index);
      rows[s].push_back(static_cast<int64_t>(j - first));
      out.indices[j - first] = index;
      out.sources[j - first] = static_cast<uint32_t>(s);
    }
    for (size_t s = 0; s < sources.size(); ++s) {
      if (indices[s].empty()) continue;
      const Batch part = readers[s]->read(indices[s]);
      const at::Tensor where = at::tensor(rows[s], at::kLong);
      for (const auto& [name, t] : part.tensors) {
        at::Tensor& into = out.tensors[name];
        if (!into.defined()) {
          std::vector<int64_t> shape = t.sizes().vec();
          shape[0] = static_cast<int64_t>(b);
          into = at::empty(shape, t.options());
        }
        into.index_copy_(0, where, t);
      }
      for (const auto& [name, values] : part.strings) {
        std::vector<std::string>& into = out.strings[name];
        into.resize(b);
        for (size_t i = 0; i < values.size(); ++i) into[rows[s][i]] = values[i];
      }
    }
    out.num_real = static_cast<int64_t>(b);
    // Only now, when every read has succeeded: a failed batch is not consumed.
    slots += global_batch();
    drawn = std::move(counts);
    return out;
  }
};

Mixture::Mixture(std::vector<MixtureSource> sources, MixtureOptions options)
    : impl_(std::make_unique<Impl>()) {
  LOOM_CHECK(!sources.empty(), InvalidArgument, "Mixture: no sources");
  LOOM_CHECK(options.batch_size >= 1, InvalidArgument, "Mixture: batch_size must be >= 1, got ",
             options.batch_size);
  LOOM_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size,
             InvalidArgument, "Mixture: rank ", options.rank, " is outside [0, ",
             options.world_size, ")");
  Impl& m = *impl_;
  m.sources = std::move(sources);
  m.options = options;
  std::string first_layout;
  for (size_t s = 0; s < m.sources.size(); ++s) {
    const MixtureSource& source = m.sources[s];
    LOOM_CHECK(std::isfinite(source.weight) && source.weight > 0, InvalidArgument,
               "Mixture: source ", s, " (", source.dataset.string(), ") has weight ", source.weight,
               "; weights must be positive and finite");
    ReaderOptions ro{.batch_size = 1,
                     .seq_len = options.seq_len,
                     .sampling = options.sampling,
                     .pad_id = options.pad_id,
                     .seed = options.seed,
                     .prefetch = 0,
                     .verify_chunks = options.verify_chunks,
                     .registry = options.registry};
    ro.remote = options.remote;
    ro.cache = options.cache;
    ro.lookahead_steps = 0;
    m.readers.push_back(std::make_unique<Reader>(source.dataset, ro));
    m.sizes.push_back(m.readers.back()->num_samples());
    m.order_seeds.push_back(util::splitmix64(options.seed ^ kOrderTag, s));
    if (source.epochs == SourceEpochs::kRepeat) m.all_stop = false;
    // Rows of every source must stack into one batch.
    const std::string layout = layout_of(m.readers.back()->read({0}));
    if (s == 0) first_layout = layout;
    LOOM_CHECK(
        layout == first_layout, InvalidArgument, "Mixture: source ", s, " (",
        source.dataset.string(), ") gives rows [", layout, "] but source 0 (",
        m.sources[0].dataset.string(), ") gives [", first_layout,
        "]; mix datasets of one kind with the same fields (token datasets with one seq_len)");
  }
  m.drawn.assign(m.sources.size(), 0);
  m.orders.resize(m.sources.size());
  m.order_epochs.assign(m.sources.size(), 0);
}

Mixture::~Mixture() = default;

Batch Mixture::next() { return impl_->next(); }
void Mixture::skip(uint64_t steps) { impl_->skip(steps); }
bool Mixture::exhausted() const { return impl_->exhausted(); }

MixtureState Mixture::state() const {
  MixtureState state;
  state.seed = impl_->options.seed;
  state.slots = impl_->slots;
  for (size_t s = 0; s < impl_->sources.size(); ++s) {
    const ResolvedDataset& dataset = impl_->readers[s]->dataset();
    state.sources.push_back({impl_->readers[s]->manifest().version, dataset.ref, impl_->drawn[s]});
  }
  return state;
}

void Mixture::restore(const MixtureState& state) {
  const MixtureState mine = this->state();
  LOOM_CHECK(state.seed == mine.seed, InvalidArgument, "Mixture::restore: the state has seed ",
             state.seed, " but this mixture ", mine.seed, "; the draws would differ");
  LOOM_CHECK(state.sources.size() == mine.sources.size(), InvalidArgument,
             "Mixture::restore: the state has ", state.sources.size(), " sources but this mixture ",
             mine.sources.size());
  uint64_t total = 0;
  for (size_t s = 0; s < mine.sources.size(); ++s) {
    LOOM_CHECK(state.sources[s].dataset_version == mine.sources[s].dataset_version, InvalidArgument,
               "Mixture::restore: source ", s, " (", impl_->sources[s].dataset.string(),
               ") is version ", mine.sources[s].dataset_version,
               " but the state was saved with version ", state.sources[s].dataset_version,
               (state.sources[s].dataset.empty() ? "" : " (" + state.sources[s].dataset + ")"),
               "; open the version the run started with");
    total += state.sources[s].drawn;
  }
  LOOM_CHECK(total == state.slots, InvalidArgument,
             "Mixture::restore: the sources' draws add up to ", total, " but the state has ",
             state.slots, " slots");
  impl_->slots = state.slots;
  for (size_t s = 0; s < mine.sources.size(); ++s) impl_->drawn[s] = state.sources[s].drawn;
}

int64_t Mixture::batch_size() const { return impl_->options.batch_size; }
std::string Mixture::state_json() const { return state().to_json(); }
void Mixture::restore_json(const std::string& json) { restore(MixtureState::from_json(json)); }
const Reader& Mixture::source(size_t i) const {
  LOOM_CHECK(i < impl_->readers.size(), InvalidArgument, "Mixture: no source ", i);
  return *impl_->readers[i];
}
const std::vector<MixtureSource>& Mixture::sources() const { return impl_->sources; }
size_t Mixture::num_sources() const { return impl_->readers.size(); }
const MixtureOptions& Mixture::options() const { return impl_->options; }

std::string MixtureState::to_json() const {
  nlohmann::json j;
  j["algorithm"] = kAlgorithm;
  j["order"] = Permutation::kAlgorithm;
  j["seed"] = seed;
  j["slots"] = slots;
  j["sources"] = nlohmann::json::array();
  for (const Source& s : sources) {
    nlohmann::json source = {{"dataset_version", s.dataset_version}, {"drawn", s.drawn}};
    if (!s.dataset.empty()) source["dataset"] = s.dataset;
    j["sources"].push_back(source);
  }
  return j.dump();
}

MixtureState MixtureState::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw CorruptData(detail::concat("mixture state: not JSON (", e.what(), "): ", text));
  }
  MixtureState state;
  try {
    const std::string algorithm = j.at("algorithm").get<std::string>();
    const std::string order = j.at("order").get<std::string>();
    LOOM_CHECK(algorithm == kAlgorithm && order == Permutation::kAlgorithm, InvalidArgument,
               "mixture state: written by draw algorithm '", algorithm, "' and order '", order,
               "', this Loom uses '", kAlgorithm, "' and '", Permutation::kAlgorithm,
               "'; its positions would mean other samples");
    state.seed = util::integer_field<uint64_t>(j.at("seed"), "seed", "mixture state");
    state.slots = util::integer_field<uint64_t>(j.at("slots"), "slots", "mixture state");
    for (const nlohmann::json& s : j.at("sources")) {
      state.sources.push_back(
          {s.at("dataset_version").get<std::string>(), s.value("dataset", std::string()),
           util::integer_field<uint64_t>(s.at("drawn"), "drawn", "mixture state")});
    }
  } catch (const nlohmann::json::exception& e) {
    throw CorruptData(
        detail::concat("mixture state: a field is missing or mistyped (", e.what(), "): ", text));
  }
  return state;
}

}  // namespace loom::data
