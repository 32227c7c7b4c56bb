// `loom data serve DATASET`: a web view of exactly what the model sees: the samples rank r
// reads at step s of a run with the given reader options (the same position `loom data show`
// prints), decoded: text with its token boundaries and ids, images drawn, labels named, other
// fields as values. One page with its script inline (nothing fetched from elsewhere), read-only,
// on loopback unless --public with a token.
#include <httplib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "data_commands.h"
#include "http_serve.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "util/number.h"

namespace loom::cli {
namespace {

using nlohmann::json;

struct ServeArgs {
  DataPosition at;
  std::string against;  // --against: another version to diff with ("": no diff view)
  std::string address = "127.0.0.1:8471";
  bool public_address = false;
};

// A tensor field's value: dtype, shape and its first 65536 elements (all of an image).
json tensor_json(const data::Field& field, const at::Tensor& t) {
  const at::Tensor flat = t.flatten().to(at::kDouble).contiguous();
  const int64_t n = std::min<int64_t>(flat.numel(), 65536);
  std::vector<double> values(flat.data_ptr<double>(), flat.data_ptr<double>() + n);
  return {{"dtype", field.dtype},
          {"shape", t.sizes().vec()},
          {"values", values},
          {"truncated", n < flat.numel()},
          {"image", t.dim() == 2 && t.scalar_type() == at::kByte}};
}

// An [H, W, C] image's shape and every pixel value, row by row.
json pixels_json(const at::Tensor& image) {
  const at::Tensor hwc = image.contiguous();
  const uint8_t* p = hwc.data_ptr<uint8_t>();
  return {{"shape", hwc.sizes().vec()}, {"values", std::vector<int>(p, p + hwc.numel())}};
}

std::vector<double> series(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

// What the page draws beside the fields of a multimodal or episode record.
void add_layout_json(const data::Manifest& m, const data::Batch& batch, int64_t r, json& sample) {
  if (batch.tensors.count("step")) {  // a transition
    sample["transition"] = {{"episode", batch["episode"][r].item<int64_t>()},
                            {"step", batch["step"][r].item<int64_t>()},
                            {"return", batch["return"][r].item<double>()}};
    if (batch.tensors.count("advantage")) {
      sample["transition"]["advantage"] = batch["advantage"][r].item<double>();
    }
  } else if (m.layout == data::RecordLayout::kEpisodes) {
    const at::Tensor reward = unpadded(batch, "reward", r);
    json episode = {{"reward", series(reward)},
                    {"return", series(batch["return"][r].narrow(0, 0, reward.size(0)))}};
    if (batch.tensors.count("advantage")) {
      episode["advantage"] = series(batch["advantage"][r].narrow(0, 0, reward.size(0)));
    }
    sample["episode"] = std::move(episode);
  } else if (m.layout == data::RecordLayout::kMultimodal) {
    const at::Tensor positions = unpadded(batch, "image_positions", r);
    json images = json::array();
    for (int64_t k = 0; k < positions.size(0); ++k) {
      images.push_back(pixels_json(image_of(batch, "images", r, k)));
    }
    sample["sequence"] = {{"tokens", series(unpadded(batch, "tokens", r))},
                          {"positions", series(positions)},
                          {"images", std::move(images)}};
  }
}

// Each row of `batch` as the page draws it: token ids with their text, or the fields.
json samples_json(const data::Manifest& m, const data::Batch& batch,
                  const data::Vocabulary* vocab) {
  json samples = json::array();
  for (int64_t r = 0; r < static_cast<int64_t>(batch.indices.size()); ++r) {
    json sample = {{"row", r}, {"index", batch.indices[r]}, {"padding", r >= batch.num_real}};
    if (m.kind == data::DatasetKind::kTokens) {
      const at::Tensor row = batch["tokens"][r];
      const at::Tensor mask = batch.tensors.count("mask") ? batch["mask"][r] : at::Tensor();
      json tokens = json::array();
      for (int64_t k = 0; k < row.size(0); ++k) {
        if (mask.defined() && !mask[k].item<bool>()) break;
        const int64_t id = row[k].item<int64_t>();
        tokens.push_back(
            {{"id", id},
             {"text", vocab != nullptr ? vocab->text(static_cast<int>(id)) : std::to_string(id)}});
      }
      sample["tokens"] = std::move(tokens);
    } else {
      json fields = json::object();
      for (const data::Field& field : m.schema) {
        switch (field.type) {
          case data::FieldType::kText:
            fields[field.name] = {{"text", batch.strings.at(field.name)[r]}};
            break;
          case data::FieldType::kBytes:
            fields[field.name] = {{"bytes", batch.strings.at(field.name)[r].size()}};
            break;
          case data::FieldType::kInt: {
            const int64_t v = batch[field.name][r].item<int64_t>();
            json value = {{"int", v}};
            if (v >= 0 && v < static_cast<int64_t>(field.classes.size())) {
              value["class"] = field.classes[static_cast<size_t>(v)];
            }
            fields[field.name] = std::move(value);
            break;
          }
          case data::FieldType::kFloat:
            fields[field.name] = {{"float", batch[field.name][r].item<double>()}};
            break;
          case data::FieldType::kTensor:
            fields[field.name] = tensor_json(field, unpadded(batch, field.name, r));
            break;
          case data::FieldType::kImage:
            fields[field.name] = {{"pixels", pixels_json(image_of(batch, field.name, r))}};
            break;
          case data::FieldType::kImages: {
            json images = json::array();
            const int64_t n = batch[field.name + "_mask"][r].sum().item<int64_t>();
            for (int64_t k = 0; k < n; ++k) {
              images.push_back(pixels_json(image_of(batch, field.name, r, k)));
            }
            fields[field.name] = {{"pixel_list", std::move(images)}};
            break;
          }
        }
      }
      if (m.layout == data::RecordLayout::kMultimodal) {
        for (const char* shown : {"tokens", "images", "image_positions"}) fields.erase(shown);
      }
      add_layout_json(m, batch, r, sample);
      sample["fields"] = std::move(fields);
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

// The batch rank `rank` reads at `step`, as /api/batch answers it. A mixture's batch has no
// epoch (each source has its own) and says each sample's source.
json batch_json(const DataPosition& at, int rank, uint64_t step, const data::Vocabulary* vocab) {
  if (!at.mix.empty()) {
    const std::unique_ptr<data::Mixture> mixture = mixture_at(at, rank, step);
    const data::Batch batch = mixture->next();
    json samples = samples_json(mixture->source(0).manifest(), batch, vocab);
    for (size_t r = 0; r < samples.size(); ++r) {
      samples[r]["source"] = batch.sources[r];
      samples[r]["source_name"] = at.mix[batch.sources[r]].dataset;
    }
    return {{"rank", rank}, {"step", step}, {"samples", std::move(samples)}};
  }
  const std::unique_ptr<data::Reader> reader = reader_at(at, rank, step);
  const uint64_t steps = reader->steps_per_epoch();
  const data::Batch batch = reader->next();
  return {{"rank", rank},
          {"step", step},
          {"epoch", batch.epoch},
          {"epoch_step", step % steps},
          {"steps_per_epoch", steps},
          {"samples", samples_json(reader->manifest(), batch, vocab)}};
}

// The diff view (--against): what the dataset stores compared with another version of it,
// entry by entry (documents of a token dataset, records of a record dataset, by content hash,
// data::Reader::entry): how many are in both, which were removed and which added, and the
// first kDiffShown of each drawn as samples. Entries with the same content count as the same
// wherever they sit; of n equal entries in one version and m in the other, min(n, m) are the
// same and the rest, the last ones, removed or added.
constexpr size_t kDiffShown = 20;

// One side of a diff: its reader, whose sample i is entry i (a token dataset's documents cut
// to seq_len + 1 tokens; a record dataset's whole records), and its vocabulary.
struct DiffSide {
  std::string dataset;
  std::unique_ptr<data::Reader> reader;
  std::shared_ptr<data::Vocabulary> vocab;
};

DiffSide diff_side(const DataPosition& at, const std::string& dataset) {
  DiffSide side{dataset,
                std::make_unique<data::Reader>(
                    dataset, data::ReaderOptions{.seq_len = at.seq_len,
                                                 .sampling = data::TokenSampling::kDocument,
                                                 .pad_id = at.pad_id,
                                                 .gamma = at.gamma,
                                                 .gae_lambda = at.gae_lambda,
                                                 .image_channels = at.image_channels,
                                                 .prefetch = 0}),
                nullptr};
  if (!side.reader->manifest().tokenizer.empty()) {
    side.vocab = std::make_shared<data::Vocabulary>(
        data::Vocabulary::of_dataset(side.reader->dataset().dir));
  }
  return side;
}

// "name type dtype shape" of a field, as the diff names what changed.
std::string describe(const data::Field& f) {
  std::string out = data::to_string(f.type);
  if (!f.dtype.empty()) out += " " + f.dtype;
  if (f.type == data::FieldType::kTensor) {
    std::string shape;
    for (int64_t d : f.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    out += " [" + shape + "]" + (f.ragged ? " ragged" : "");
  }
  return out;
}

json diff_json(const DiffSide& old_side, const DiffSide& new_side) {
  const data::Reader& a = *old_side.reader;
  const data::Reader& b = *new_side.reader;
  // The entries of each side, counted by hash, and which of them the other side lacks.
  std::map<uint64_t, int64_t> balance;  // per hash: entries in b minus entries in a
  std::vector<data::Reader::Entry> in_a(a.num_entries()), in_b(b.num_entries());
  for (uint64_t i = 0; i < in_a.size(); ++i) --balance[(in_a[i] = a.entry(i)).hash];
  for (uint64_t i = 0; i < in_b.size(); ++i) ++balance[(in_b[i] = b.entry(i)).hash];
  // Walking from the end, the last surplus entries of each side are the ones not in the other.
  auto surplus = [&](const std::vector<data::Reader::Entry>& entries, int64_t sign) {
    std::map<uint64_t, int64_t> left;
    for (const auto& [h, n] : balance) {
      if (n * sign > 0) left[h] = n * sign;
    }
    std::vector<uint64_t> out;
    for (uint64_t i = entries.size(); i-- > 0;) {
      const auto it = left.find(entries[i].hash);
      if (it != left.end() && it->second > 0) {
        --it->second;
        out.push_back(i);
      }
    }
    std::reverse(out.begin(), out.end());
    return out;
  };
  const std::vector<uint64_t> removed = surplus(in_a, -1), added = surplus(in_b, 1);
  auto shown = [](const DiffSide& side, const std::vector<data::Reader::Entry>& entries,
                  const std::vector<uint64_t>& which) {
    const std::vector<uint64_t> first(
        which.begin(), which.begin() + static_cast<int64_t>(std::min(which.size(), kDiffShown)));
    json samples =
        samples_json(side.reader->manifest(), side.reader->read(first), side.vocab.get());
    for (size_t k = 0; k < first.size(); ++k) samples[k]["size"] = entries[first[k]].size;
    return samples;
  };
  auto side_json = [](const DiffSide& side) {
    const data::Manifest& m = side.reader->manifest();
    return json{{"dataset", side.dataset},
                {"version", m.version},
                {"entries", side.reader->num_entries()},
                {"tokenizer", !m.tokenizer.empty()}};
  };
  json schema = json::array();  // the fields that differ: [{name, old, new}] ("" where absent)
  std::map<std::string, std::pair<std::string, std::string>> fields;
  for (const data::Field& f : a.manifest().schema) fields[f.name].first = describe(f);
  for (const data::Field& f : b.manifest().schema) fields[f.name].second = describe(f);
  for (const auto& [name, types] : fields) {
    if (types.first != types.second) {
      schema.push_back({{"name", name}, {"old", types.first}, {"new", types.second}});
    }
  }
  return {{"old", side_json(old_side)},
          {"new", side_json(new_side)},
          {"unit", a.manifest().kind == data::DatasetKind::kTokens ? "documents" : "records"},
          {"schema", std::move(schema)},
          {"same", in_a.size() - removed.size()},
          {"removed", removed.size()},
          {"added", added.size()},
          {"removed_samples", shown(old_side, in_a, removed)},
          {"added_samples", shown(new_side, in_b, added)}};
}

json dataset_json(const DataPosition& at, std::optional<uint64_t> resume) {
  const std::unique_ptr<data::Reader> reader = reader_at(at, 0, 0);
  json mixture = json::array();  // a run's mixture: its sources, the first one's manifest above
  for (const data::RunReader::Source& s : at.mix) {
    mixture.push_back({{"dataset", s.dataset},
                       {"version", s.version},
                       {"weight", s.weight},
                       {"one_epoch", s.stop}});
  }
  const data::Manifest& m = reader->manifest();
  json schema = json::array();
  for (const data::Field& f : m.schema) {
    schema.push_back({{"name", f.name},
                      {"type", data::to_string(f.type)},
                      {"dtype", f.dtype},
                      {"shape", f.shape},
                      {"classes", f.classes}});
  }
  return {{"dataset", at.dir},
          {"version", m.version},
          {"kind", m.kind == data::DatasetKind::kTokens ? "tokens" : "records"},
          {"samples", reader->num_samples()},
          {"steps_per_epoch", reader->steps_per_epoch()},
          {"world", at.world},
          {"batch", at.batch},
          {"seq_len", at.seq_len},
          {"seed", at.seed},
          {"sampling", !at.sampling.empty()                        ? at.sampling
                       : m.kind == data::DatasetKind::kTokens      ? "packed"
                       : m.layout == data::RecordLayout::kEpisodes ? "episode"
                                                                   : ""},
          {"layout", m.kind == data::DatasetKind::kTokens ? "" : data::to_string(m.layout)},
          {"epoch_end", at.epoch_end},
          {"tokenizer", !m.tokenizer.empty()},
          {"run", at.run},
          {"resume_step", resume && at.checkpointed ? json(*resume) : json()},
          {"mixture", mixture},
          {"schema", std::move(schema)}};
}

// Statistics over the first kStatsSamples samples of the dataset (all of a smaller one), per
// field: an int field's count per value (named by its classes), a text or bytes field's
// length histogram, a float field's value histogram, a ragged tensor field's length histogram
// (a sequence's tokens, an episode's steps), another tensor field's count per shape; a text
// field of at most kTextValues distinct values is counted per value as well. Token
// datasets: their totals from the manifest, and the length histogram of their first
// kStatsSamples documents.
constexpr uint64_t kStatsSamples = 200'000;
// A text field with at most this many distinct values is also counted per value.
constexpr size_t kTextValues = 20;

// `values` in 10 equal-width bins from their least to their greatest: [{from, to, count}].
json histogram(const std::vector<double>& values) {
  json bins = json::array();
  if (values.empty()) return bins;
  const auto [lo_it, hi_it] = std::minmax_element(values.begin(), values.end());
  const double lo = *lo_it, hi = *hi_it;
  const int n = hi > lo ? 10 : 1;
  std::vector<uint64_t> counts(static_cast<size_t>(n), 0);
  for (double v : values) {
    const int b = hi > lo ? std::min(n - 1, static_cast<int>((v - lo) / (hi - lo) * n)) : 0;
    ++counts[static_cast<size_t>(b)];
  }
  for (int b = 0; b < n; ++b) {
    bins.push_back({{"from", lo + (hi - lo) * b / n},
                    {"to", hi > lo ? lo + (hi - lo) * (b + 1) / n : hi},
                    {"count", counts[static_cast<size_t>(b)]}});
  }
  return bins;
}

json stats_json(const DataPosition& at) {
  const std::unique_ptr<data::Reader> reader = reader_at(at, 0, 0);
  const data::Manifest& m = reader->manifest();
  const uint64_t total = reader->num_samples();
  if (m.kind == data::DatasetKind::kTokens) {
    const uint64_t documents = reader->num_entries();
    std::vector<double> lengths;
    for (uint64_t d = 0; d < std::min(documents, kStatsSamples); ++d) {
      lengths.push_back(static_cast<double>(reader->entry(d).size));
    }
    json field = {{"name", "documents"},
                  {"type", "tokens"},
                  {"histogram", histogram(lengths)},
                  {"of", "their length in tokens"}};
    return {{"samples", total},          {"tokens", m.total_items()},
            {"documents", documents},    {"documents_counted", lengths.size()},
            {"shards", m.shards.size()}, {"fields", json::array({std::move(field)})}};
  }
  const uint64_t counted = std::min(total, kStatsSamples);
  json out = {{"samples", total}, {"counted", counted}, {"fields", json::array()}};
  std::map<std::string, std::map<std::string, uint64_t>> counts;       // int and tensor fields
  std::map<std::string, std::vector<double>> values;                   // text, bytes, float fields
  std::map<std::string, std::map<std::string, uint64_t>> text_counts;  // text fields, while few
  for (uint64_t begin = 0; begin < counted; begin += 256) {
    std::vector<uint64_t> indices;
    for (uint64_t i = begin; i < std::min(counted, begin + 256); ++i) indices.push_back(i);
    const data::Batch batch = reader->read(indices);
    for (const data::Field& f : m.schema) {
      for (int64_t r = 0; r < static_cast<int64_t>(indices.size()); ++r) {
        switch (f.type) {
          case data::FieldType::kInt: {
            const int64_t v = batch[f.name][r].item<int64_t>();
            const bool named = v >= 0 && v < static_cast<int64_t>(f.classes.size());
            ++counts[f.name][std::to_string(v) +
                             (named ? " (" + f.classes[static_cast<size_t>(v)] + ")" : "")];
            break;
          }
          case data::FieldType::kTensor:
            if (f.ragged) {
              values[f.name].push_back(static_cast<double>(unpadded(batch, f.name, r).size(0)));
              break;
            }
            [[fallthrough]];
          case data::FieldType::kImage:
          case data::FieldType::kImages: {
            const bool image = f.type == data::FieldType::kImage;
            const at::Tensor value = image ? image_of(batch, f.name, r)
                                     : f.type == data::FieldType::kImages
                                         ? batch[f.name + "_mask"][r].sum()
                                         : unpadded(batch, f.name, r);
            std::string shape;
            for (int64_t d : value.dim() == 0 ? std::vector<int64_t>{value.item<int64_t>()}
                                              : value.sizes().vec()) {
              shape += (shape.empty() ? "" : "x") + std::to_string(d);
            }
            ++counts[f.name][shape];
            break;
          }
          case data::FieldType::kText:
          case data::FieldType::kBytes: {
            const std::string& value = batch.strings.at(f.name)[static_cast<size_t>(r)];
            values[f.name].push_back(static_cast<double>(value.size()));
            // A text field of few values (a source, a language, a split) is counted per value.
            std::map<std::string, uint64_t>& seen = text_counts[f.name];
            if (f.type == data::FieldType::kText && seen.size() <= kTextValues) ++seen[value];
            break;
          }
          case data::FieldType::kFloat:
            values[f.name].push_back(batch[f.name][r].item<double>());
            break;
        }
      }
    }
  }
  for (const data::Field& f : m.schema) {
    json field = {{"name", f.name}, {"type", data::to_string(f.type)}};
    if (f.type == data::FieldType::kInt || (f.type == data::FieldType::kTensor && !f.ragged) ||
        f.type == data::FieldType::kImage || f.type == data::FieldType::kImages) {
      json c = json::array();
      for (const auto& [key, n] : counts[f.name]) c.push_back({{"key", key}, {"count", n}});
      field["counts"] = std::move(c);
    } else {
      field["histogram"] = histogram(values[f.name]);
      field["of"] = f.type == data::FieldType::kFloat    ? "its value"
                    : f.type == data::FieldType::kTensor ? "its length (first dimension)"
                                                         : "its length in bytes";
      const auto text = text_counts.find(f.name);
      if (text != text_counts.end() && text->second.size() <= kTextValues) {
        json c = json::array();
        for (const auto& [key, n] : text->second) c.push_back({{"key", key}, {"count", n}});
        field["counts"] = std::move(c);
      }
    }
    out["fields"].push_back(std::move(field));
  }
  return out;
}

// A mixture's realised weights over steps 0 to `step` (all ranks): each source's configured
// weight and share, the samples drawn from it and their share of all drawn. Its sources leave
// the mix after one epoch when they are kStop, so the two shares differ by more than chance
// then.
json mixture_stats_json(const DataPosition& at, uint64_t step) {
  const std::unique_ptr<data::Mixture> mixture = mixture_at(at, 0, step + 1);
  const data::MixtureState state = mixture->state();
  double total = 0;
  for (const data::RunReader::Source& s : at.mix) total += s.weight;
  json sources = json::array();
  for (size_t k = 0; k < at.mix.size(); ++k) {
    const data::RunReader::Source& s = at.mix[k];
    const uint64_t drawn = state.sources[k].drawn;
    sources.push_back(
        {{"dataset", s.dataset},
         {"weight", s.weight},
         {"one_epoch", s.stop},
         {"share", s.weight / total},
         {"drawn", drawn},
         {"realised", static_cast<double>(drawn) / static_cast<double>(state.slots)}});
  }
  return {{"steps", step + 1}, {"samples", state.slots}, {"mixture", std::move(sources)}};
}

// A query parameter as a non-negative integer; InvalidArgument naming it otherwise.
uint64_t number_param(const httplib::Request& req, const char* name) {
  const std::string text = req.has_param(name) ? req.get_param_value(name) : "0";
  const std::optional<uint64_t> value = util::parse_unsigned(text);
  LOOM_CHECK(value.has_value(), InvalidArgument, "the parameter ", name,
             " must be a non-negative integer, got '", text, "'");
  return *value;
}

// Answers with the JSON `body()` returns; with its error as plain text otherwise: 400 for bad
// parameters (InvalidArgument), 500 for the rest.
void answer(httplib::Response& res, const std::function<std::string()>& body) {
  try {
    res.set_content(body(), "application/json");
  } catch (const InvalidArgument& e) {
    res.status = 400;
    res.set_content(std::string(e.what()) + "\n", "text/plain");
  } catch (const Error& e) {
    res.status = 500;
    res.set_content(std::string(e.what()) + "\n", "text/plain");
  }
}

const char* page();

int run_serve(const ServeArgs& args) {
  try {
    DataPosition at = args.at;
    const std::optional<uint64_t> resume = from_run(at);
    // Opening it once checks the dataset and the options before the server starts.
    json dataset = dataset_json(at, resume);
    dataset["against"] = args.against;
    std::shared_ptr<data::Vocabulary> vocab;
    {
      const std::unique_ptr<data::Reader> reader = reader_at(at, 0, 0);
      if (!reader->manifest().tokenizer.empty()) {
        vocab =
            std::make_shared<data::Vocabulary>(data::Vocabulary::of_dataset(reader->dataset().dir));
      }
    }
    httplib::Server server;
    server.Get("/", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(page(), "text/html; charset=utf-8");
    });
    server.Get("/api/dataset", [dataset](const httplib::Request&, httplib::Response& res) {
      res.set_content(dataset.dump(), "application/json");
    });
    // Computed on first request, once.
    auto stats = std::make_shared<std::pair<std::mutex, std::string>>();
    server.Get("/api/stats", [at, stats](const httplib::Request& req, httplib::Response& res) {
      answer(res, [&] {
        if (!at.mix.empty()) {  // up to the page's step: a few draws, not cached
          return mixture_stats_json(at, number_param(req, "step")).dump();
        }
        std::lock_guard<std::mutex> lock(stats->first);
        if (stats->second.empty()) stats->second = stats_json(at).dump();
        return stats->second;
      });
    });
    // The diff view: both sides opened (and checked to be comparable) before the server
    // starts, the comparison computed on first request, once.
    std::shared_ptr<std::pair<DiffSide, DiffSide>> sides;
    if (!args.against.empty()) {
      LOOM_CHECK(at.mix.empty(), InvalidArgument, "--against: ", at.run,
                 " reads a mixture; the diff view compares two datasets (serve one of them)");
      sides = std::make_shared<std::pair<DiffSide, DiffSide>>(diff_side(at, args.against),
                                                              diff_side(at, at.dir));
      const data::Manifest& a = sides->first.reader->manifest();
      const data::Manifest& b = sides->second.reader->manifest();
      auto kind = [](const data::Manifest& m) {
        return m.kind == data::DatasetKind::kTokens ? "a token dataset" : "a record dataset";
      };
      LOOM_CHECK(a.kind == b.kind, InvalidArgument, "--against ", args.against, ": it is ", kind(a),
                 " and ", at.dir, " ", kind(b),
                 "; only two versions of one kind of dataset can be compared");
    }
    auto diff = std::make_shared<std::pair<std::mutex, std::string>>();
    server.Get("/api/diff", [sides, diff](const httplib::Request&, httplib::Response& res) {
      if (!sides) {
        res.status = 404;
        res.set_content("no diff: start the server with --against OTHER_VERSION\n", "text/plain");
        return;
      }
      answer(res, [&] {
        std::lock_guard<std::mutex> lock(diff->first);
        if (diff->second.empty()) diff->second = diff_json(sides->first, sides->second).dump();
        return diff->second;
      });
    });
    server.Get("/api/batch", [at, vocab](const httplib::Request& req, httplib::Response& res) {
      answer(res, [&] {
        const uint64_t rank = number_param(req, "rank");
        const uint64_t step = number_param(req, "step");
        LOOM_CHECK(rank < static_cast<uint64_t>(at.world), InvalidArgument, "rank ", rank,
                   " is not a rank of a world of ", at.world);
        return batch_json(at, static_cast<int>(rank), step, vocab.get()).dump();
      });
    });
    serve_until_stopped(server, args.address, args.public_address, "the data viewer",
                        "samples of " + at.dir);
    return kExitOk;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  }
}

const char* page() {
  return R"PAGE(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Loom data</title>
<style>
  body { font: 14px/1.5 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
  header { background: #1d2330; color: #fff; padding: 10px 20px; }
  header h1 { font-size: 17px; margin: 0; display: inline; }
  header .muted { color: #aab1c0; margin-left: 16px; }
  nav { padding: 10px 20px; display: flex; gap: 10px; align-items: center; flex-wrap: wrap;
        background: #fff; border-bottom: 1px solid #e3e6ec; }
  nav input { width: 90px; }
  main { padding: 12px 20px; }
  .sample { background: #fff; border: 1px solid #e3e6ec; border-radius: 6px; padding: 10px 12px;
            margin-bottom: 10px; }
  .sample h3 { font-size: 13px; margin: 0 0 6px; color: #6b7385; font-weight: 600; }
  .sample.padding { opacity: 0.5; }
  .tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
  .tok { border-radius: 2px; }
  .tok:nth-child(odd) { background: #e7efff; }
  .tok:nth-child(even) { background: #fff2d6; }
  .tok:hover { outline: 1px solid #2563c9; }
  .tokens.ids .tok { margin-right: 3px; padding: 0 2px; }
  table.fields td { padding: 2px 10px 2px 0; vertical-align: top; }
  table.fields td:first-child { color: #6b7385; }
  canvas.image { image-rendering: pixelated; border: 1px solid #e3e6ec; vertical-align: middle; }
  .sequence canvas.image { margin: 2px 4px; }
  svg.episode { background: #fbfcfd; border: 1px solid #e3e6ec; border-radius: 4px; }
  .plot { margin: 4px 0 8px; }
  .transition { font-family: ui-monospace, monospace; margin-bottom: 4px; }
  .error { color: #c0392b; font-weight: 600; }
  .stat { background: #fff; border: 1px solid #e3e6ec; border-radius: 6px; padding: 10px 12px;
          margin-bottom: 10px; }
  .stat h3 { font-size: 13px; margin: 0 0 6px; }
  .stat .row { display: flex; align-items: center; gap: 8px; font-size: 12px; margin: 2px 0; }
  .stat .key { width: 160px; text-align: right; color: #6b7385; }
  .stat .bar { height: 12px; background: #2563c9; border-radius: 2px; }
  .muted { color: #6b7385; }
  .diff h2 { font-size: 15px; margin: 14px 0 8px; }
  #diff-removed .sample { border-left: 4px solid #c0392b; }
  #diff-added .sample { border-left: 4px solid #16a34a; }
</style>
</head>
<body>
<header><h1>Loom data</h1><span class="muted" id="dataset"></span></header>
<nav>
  <label>rank <select id="rank"></select></label>
  <label>step <input id="step" type="number" min="0" value="0"></label>
  <button id="prev">&larr; step</button><button id="next">step &rarr;</button>
  <span class="muted" id="where"></span>
  <a id="stats-link" href="?view=stats">statistics</a>
  <a id="diff-link" href="?view=diff" hidden>diff</a>
</nav>
<main id="samples"></main>
<script>
"use strict";
const $ = id => document.getElementById(id);
const el = (tag, attrs, text) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
let info = null;

function field(name, value) {
  const tr = el("tr");
  tr.append(el("td", {}, name));
  const td = el("td", {"data-field": name});
  if ("text" in value) td.textContent = JSON.stringify(value.text);
  else if ("bytes" in value) td.textContent = `${value.bytes} bytes`;
  else if ("int" in value) td.textContent = value.int + (value.class ? ` (${value.class})` : "");
  else if ("float" in value) td.textContent = String(value.float);
  else if (value.pixels) td.append(picture(value.pixels));
  else if (value.pixel_list) {
    td.append(el("span", {class: "muted"}, `${value.pixel_list.length} images `));
    for (const p of value.pixel_list) td.append(picture(p), " ");
  }
  else if (value.image) {
    const [h, w] = value.shape;
    const canvas = el("canvas", {class: "image", width: w, height: h});
    canvas.style.width = `${w * Math.max(2, Math.floor(112 / Math.max(w, h)))}px`;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(w, h);
    value.values.forEach((v, i) => { img.data.set([v, v, v, 255], 4 * i); });
    ctx.putImageData(img, 0, 0);
    td.append(canvas, el("span", {class: "muted"}, ` ${value.dtype} [${value.shape}]`));
  } else {
    // float32 values arrive as doubles: each shown as the shortest decimal of its float32.
    const shortest = v => {
      for (let p = 1; p < 10; ++p) if (Math.fround(+v.toPrecision(p)) === v) return +v.toPrecision(p);
      return v;
    };
    const shown = value.values.slice(0, 32).map(value.dtype === "float32" ? shortest : v => v);
    td.textContent = `${value.dtype} [${value.shape}] ` + shown.join(" ") +
                     (value.values.length > 32 || value.truncated ? " …" : "");
  }
  tr.append(td);
  return tr;
}

// An [H, W, C] image (C 1 to 4) on a canvas, each pixel as stored.
function picture(p) {
  const [h, w, c] = p.shape;
  const canvas = el("canvas", {class: "image", width: w, height: h, "data-shape": p.shape.join("x")});
  canvas.style.width = `${w * Math.max(1, Math.floor(160 / Math.max(w, h)))}px`;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(w, h);
  for (let i = 0; i < w * h; ++i) {
    const v = p.values.slice(i * c, i * c + c);
    const rgb = c >= 3 ? v.slice(0, 3) : [v[0], v[0], v[0]];
    img.data.set([...rgb, c === 2 || c === 4 ? v[c - 1] : 255], 4 * i);
  }
  ctx.putImageData(img, 0, 0);
  return canvas;
}

// A multimodal sequence: its tokens with each image in its place.
function sequence(seq) {
  const p = el("div", {class: "tokens ids sequence"});
  let k = 0;
  for (let t = 0; t <= seq.tokens.length; ++t) {
    for (; k < seq.positions.length && seq.positions[k] === t; ++k) {
      const c = picture(seq.images[k]);
      c.dataset.image = k;
      p.append(c, " ");
    }
    if (t < seq.tokens.length) {
      p.append(el("span", {class: "tok", "data-id": seq.tokens[t], title: `id ${seq.tokens[t]}`},
                  String(seq.tokens[t])));
    }
  }
  return p;
}

// An episode's per-step series as lines on one plot (reward, return, advantage).
function episodePlot(ep) {
  const names = ["reward", "return", "advantage"].filter(n => ep[n]);
  const colors = {reward: "#2563c9", return: "#d97706", advantage: "#16a34a"};
  const all = names.flatMap(n => ep[n]);
  const lo = Math.min(0, ...all), hi = Math.max(0, ...all);
  const W = 480, H = 140, n = ep.reward.length;
  const x = t => n > 1 ? 10 + t * (W - 20) / (n - 1) : W / 2;
  const y = v => hi > lo ? H - 10 - (v - lo) * (H - 20) / (hi - lo) : H / 2;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  svg.setAttribute("class", "episode");
  const axis = document.createElementNS(ns, "line");
  for (const [k, v] of Object.entries({x1: 0, x2: W, y1: y(0), y2: y(0), stroke: "#c9ced8"}))
    axis.setAttribute(k, v);
  svg.append(axis);
  for (const name of names) {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", ep[name].map((v, t) => `${x(t)},${y(v)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colors[name]);
    line.setAttribute("stroke-width", 2);
    line.dataset.series = name;
    line.dataset.values = JSON.stringify(ep[name]);
    svg.append(line);
  }
  const box = el("div", {class: "plot"});
  box.append(el("div", {class: "muted"}, `${n} steps · ` +
      names.map(nm => `${nm} (${colors[nm] === "#2563c9" ? "blue" : colors[nm] === "#d97706" ?
                                 "orange" : "green"})`).join(", ")), svg);
  return box;
}

// The JSON at `url`; or, when the server refuses, its reason shown in `box` and null.
async function fetchOrShowError(box, url) {
  const res = await fetch(url);
  if (res.ok) return res.json();
  box.replaceChildren(el("div", {class: "error"}, await res.text()));
  document.body.dataset.ready = "1";
  return null;
}

async function show() {
  const rank = Number($("rank").value), step = Math.max(0, Number($("step").value) || 0);
  document.body.dataset.ready = "0";
  history.replaceState(null, "", `?rank=${rank}&step=${step}`);
  const box = $("samples");
  const b = await fetchOrShowError(box, `api/batch?rank=${rank}&step=${step}`);
  if (!b) return;
  $("where").textContent = `rank ${b.rank} of ${info.world}, step ${b.step}` +
      (b.epoch !== undefined ? ` = epoch ${b.epoch} step ${b.epoch_step} of ${b.steps_per_epoch}`
                             : "") + `; seed ${info.seed}, ${info.batch} per rank`;
  $("stats-link").href = `?view=stats&step=${step}`;
  box.replaceChildren(...b.samples.map(s => sampleDiv(s,
      `sample ${s.row}: ` + (s.source !== undefined ? `source ${s.source} (${s.source_name}), ` : "") +
      `dataset index ${s.index}` + (s.padding ? " (padding: masked out)" : ""),
      info.tokenizer)));
  document.body.dataset.ready = "1";
}

// One sample as the page draws it, under `title`.
function sampleDiv(s, title, tokenizer) {
  const div = el("div", {class: "sample" + (s.padding ? " padding" : ""), "data-index": s.index,
                         "data-row": s.row});
  div.append(el("h3", {}, title));
  if (s.tokens) {
    // Without a vocabulary a token is its id: spaced apart.
    const p = el("div", {class: tokenizer ? "tokens" : "tokens ids"});
    for (const t of s.tokens) p.append(el("span", {class: "tok", "data-id": t.id,
                                                   title: `id ${t.id}`}, t.text));
    div.append(p);
  } else {
    if (s.sequence) div.append(sequence(s.sequence));
    if (s.episode) div.append(episodePlot(s.episode));
    if (s.transition) {
      const t = s.transition;
      div.append(el("div", {class: "transition", "data-episode": t.episode, "data-step": t.step},
                    `episode ${t.episode}, step ${t.step}: return ${t.return}` +
                    (t.advantage !== undefined ? `, advantage ${t.advantage}` : "")));
    }
    const table = el("table", {class: "fields"});
    for (const [name, value] of Object.entries(s.fields)) table.append(field(name, value));
    div.append(table);
  }
  return div;
}

async function showDiff() {
  document.body.dataset.ready = "0";
  $("where").textContent = `diff with ${info.against}`;
  const box = $("samples");
  const d = await fetchOrShowError(box, "api/diff");
  if (!d) return;
  const u = d.unit;
  const head = el("div", {class: "stat", id: "diff-summary"});
  head.append(el("h3", {}, `${d.same} ${u} in both, ${d.removed} removed, ${d.added} added`),
              el("div", {class: "muted"}, `old: ${d.old.dataset} (version ${d.old.version}, ` +
                 `${d.old.entries} ${u}) · new: ${d.new.dataset} (version ${d.new.version}, ` +
                 `${d.new.entries} ${u})`));
  const blocks = [head];
  if (d.schema.length) {
    const div = el("div", {class: "stat", id: "diff-schema"});
    div.append(el("h3", {}, "fields that changed"));
    for (const f of d.schema) {
      div.append(el("div", {class: "row", "data-field": f.name},
                    `${f.name}: ${f.old || "(absent)"} → ${f.new || "(absent)"}`));
    }
    blocks.push(div);
  }
  const unit = u === "documents" ? "document" : "record";
  for (const [side, label, count, samples] of
           [["removed", "old", d.removed, d.removed_samples],
            ["added", "new", d.added, d.added_samples]]) {
    const div = el("div", {class: "diff", id: `diff-${side}`});
    div.append(el("h2", {}, `${side}: ${count} ${u}` +
                            (samples.length < count ? ` (the first ${samples.length} shown)` : "")));
    for (const s of samples) {
      const sizeText = u === "documents" ? `${s.size} tokens` : `${s.size} bytes`;
      div.append(sampleDiv(s, `${unit} ${s.index} of the ${label} version (${sizeText})`,
                           d[label].tokenizer));
    }
    blocks.push(div);
  }
  box.replaceChildren(...blocks);
  document.body.dataset.ready = "1";
}

async function showStats() {
  document.body.dataset.ready = "0";
  $("where").textContent = "statistics";
  const box = $("samples");
  const step = Number(new URLSearchParams(location.search).get("step")) || 0;
  const st = await fetchOrShowError(box, `api/stats?step=${step}`);
  if (!st) return;
  if (st.mixture) {
    // A mixture: each source's configured share beside its realised share up to this step.
    const head = el("div", {class: "stat", id: "stats-summary"});
    head.append(el("h3", {}, `mixture of ${st.mixture.length} datasets: ${st.samples} samples ` +
                             `drawn in steps 0 to ${st.steps - 1} (all ranks)`));
    const div = el("div", {class: "stat", "data-field": "mixture"});
    div.append(el("h3", {}, "realised weights (bar: realised share; configured share beside)"));
    const pct = x => `${(100 * x).toFixed(1)}%`;
    for (const m of st.mixture) {
      const row = el("div", {class: "row", "data-key": m.dataset, "data-count": m.drawn,
                             "data-share": m.share, "data-realised": m.realised});
      const bar = el("div", {class: "bar"});
      bar.style.width = `${Math.max(1, 300 * m.realised)}px`;
      row.append(el("span", {class: "key"}, m.dataset), bar,
                 el("span", {}, `${pct(m.realised)} (${m.drawn} samples); weight ${m.weight} = ` +
                                `${pct(m.share)}` + (m.one_epoch ? ", one epoch" : "")));
      div.append(row);
    }
    box.replaceChildren(head, div);
    document.body.dataset.ready = "1";
    return;
  }
  const head = el("div", {class: "stat", id: "stats-summary"});
  head.append(el("h3", {}, st.tokens !== undefined
      ? `${st.documents_counted} of ${st.documents} documents counted · ${st.tokens} tokens, ` +
        `${st.shards} shards`
      : `${st.counted} of ${st.samples} samples counted`));
  const blocks = [head];
  // A text field of few values has both its counts per value and its length histogram.
  const blocks_of = f => [
    ...(f.counts ? [{id: f.histogram ? `${f.name}:values` : f.name,
                     title: `${f.name}: count per ${["int", "text"].includes(f.type) ? "value"
                                                                                    : "shape"}`,
                     rows: f.counts.map(c => [c.key, c.count])}] : []),
    ...(f.histogram ? [{id: f.name, title: `${f.name}: histogram of ${f.of}`,
                        rows: f.histogram.map(b => [`${+b.from.toFixed(2)} – ${+b.to.toFixed(2)}`,
                                                    b.count])}] : [])];
  for (const {id, title, rows} of st.fields.flatMap(blocks_of)) {
    const div = el("div", {class: "stat", "data-field": id});
    div.append(el("h3", {}, title));
    const most = Math.max(1, ...rows.map(r => r[1]));
    for (const [key, count] of rows) {
      const row = el("div", {class: "row", "data-key": key, "data-count": count});
      const bar = el("div", {class: "bar"});
      bar.style.width = `${Math.max(1, 300 * count / most)}px`;
      row.append(el("span", {class: "key"}, key), bar, el("span", {}, String(count)));
      div.append(row);
    }
    blocks.push(div);
  }
  box.replaceChildren(...blocks);
  document.body.dataset.ready = "1";
}

async function start() {
  info = await (await fetch("api/dataset")).json();
  $("dataset").textContent = (info.run ? `run ${info.run} · ` : "") +
      (info.mixture.length
          ? `mixture of ${info.mixture.map(m => `${m.dataset} (weight ${m.weight})`).join(", ")}` +
            ` · ${info.kind}`
          : `${info.dataset} · ${info.kind} · ${info.samples} samples · version ${info.version}`) +
      (info.resume_step !== null ? ` · resumes at step ${info.resume_step}` : "");
  for (let r = 0; r < info.world; ++r) $("rank").append(el("option", {value: r}, String(r)));
  const q = new URLSearchParams(location.search);
  $("rank").value = q.get("rank") || "0";
  $("step").value = q.get("step") || String(info.resume_step ?? 0);
  if (info.against) {
    $("diff-link").hidden = false;
    $("diff-link").textContent = `diff with ${info.against}`;
  }
  if (q.get("view") === "diff") {
    $("diff-link").href = "?rank=0&step=0";
    $("diff-link").textContent = "samples";
    return showDiff();
  }
  if (q.get("view") === "stats") {
    $("stats-link").href = `?rank=0&step=${Number(q.get("step")) || 0}`;
    $("stats-link").textContent = "samples";
    return showStats();
  }
  $("rank").onchange = show;
  $("step").onchange = show;
  $("prev").onclick = () => { $("step").value = Math.max(0, Number($("step").value) - 1); show(); };
  $("next").onclick = () => { $("step").value = Number($("step").value) + 1; show(); };
  document.addEventListener("keydown", e => {
    if (e.target.tagName === "INPUT") return;
    if (e.key === "ArrowRight") $("next").click();
    if (e.key === "ArrowLeft") $("prev").click();
  });
  show();
}
start();
</script>
</body>
</html>
)PAGE";
}

}  // namespace

void register_data_serve(CLI::App& data, Action& action) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* s = data.add_subcommand(
      "serve", "Browse the samples each rank reads at each step, in a web browser.");
  s->add_option("dataset", args->at.dir,
                "the dataset directory, URL or registry name, or a run directory")
      ->required();
  add_position_options(*s, args->at);
  s->add_option("--against", args->against,
                "another version of the dataset (directory, URL or registry name): the page's "
                "diff view shows which documents or records were removed and which added");
  s->add_option("--address", args->address, "host:port to listen on (port 0: any free port)")
      ->capture_default_str();
  s->add_flag("--public", args->public_address,
              "allow an address beyond loopback; requests must then carry the token in "
              "LOOM_JOB_TOKEN as 'Authorization: Bearer <token>'");
  s->footer(
      "With your run's reader options, the page shows exactly the samples the model sees on\n"
      "each rank at each step (the same as `loom data show`): text with token boundaries and\n"
      "ids on hover, images drawn, labels named. Pick the rank and step, or use the arrow\n"
      "keys. ?view=stats: each field's value counts or length histogram. With --against\n"
      "OTHER, ?view=diff: how many documents or records the two versions share, and those\n"
      "removed and added (compared by content). Read-only; nothing but the datasets' samples,\n"
      "statistics and diff is served.\n\n"
      "Example: loom data serve data/kjv --world 2 --batch 8 --seq-len 64   then open\n"
      "http://127.0.0.1:8471/?rank=1&step=100\n"
      "A run directory in place of the dataset: the run's dataset and reader options, opening\n"
      "at the step its newest checkpoint resumes at (see `loom data show --help`).\n"
      "Diff: loom data serve kjv@2 --against kjv@1   then open http://127.0.0.1:8471/?view=diff");
  s->callback([args, &action] { action = [args] { return run_serve(*args); }; });
}

}  // namespace loom::cli
