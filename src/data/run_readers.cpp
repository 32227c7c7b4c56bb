// <run_dir>/readers.json: what Runtime::open_dataset and open_mixture opened, for the viewers.
#include "data/run_readers.h"

#include <nlohmann/json.hpp>

#include "data/reader_options_json.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A reader's entry: what it reads and the options a position depends on.
json entry_json(const std::string& dataset, const std::string& dir, const std::string& version,
                const ReaderOptions& o) {
  json entry = {{"dataset", dataset}, {"dir", dir}, {"version", version}};
  entry.update(reader_options_json(o));
  entry.erase("rank");  // rank 0's, the same on every rank but this
  return entry;
}

// A mixture's entry: its first source's, with the mixture's options and every source.
json mixture_json(const Mixture& mixture) {
  const MixtureOptions& o = mixture.options();
  json sources = json::array();
  for (size_t s = 0; s < mixture.num_sources(); ++s) {
    const Reader& reader = mixture.source(s);
    const MixtureSource& spec = mixture.sources()[s];
    sources.push_back({{"dataset", spec.dataset.string()},
                       {"dir", reader.dataset().dir.string()},
                       {"version", reader.manifest().version},
                       {"weight", spec.weight},
                       {"epochs", spec.epochs == SourceEpochs::kStop ? "stop" : "repeat"}});
  }
  json entry =
      entry_json(sources[0]["dataset"].get<std::string>(), sources[0]["dir"].get<std::string>(),
                 sources[0]["version"].get<std::string>(),
                 {.batch_size = o.batch_size,
                  .seq_len = o.seq_len,
                  .sampling = o.sampling,
                  .pad_id = o.pad_id,
                  .seed = o.seed,
                  .world_size = o.world_size});
  entry["mixture"] = std::move(sources);
  return entry;
}

json read_entries(const fs::path& file) {
  try {
    json j = json::parse(util::read_file(file));
    LOOM_CHECK(j.is_array(), CorruptData, file.string(), " is not a JSON array of readers");
    return j;
  } catch (const json::exception& e) {
    throw CorruptData(detail::concat(file.string(), " is not valid JSON: ", e.what()));
  }
}

// Adds `entry` to <run_dir>/readers.json unless an equal one is there.
void add_entry(const fs::path& run_dir, const json& entry) {
  const fs::path file = run_readers_file(run_dir);
  json entries = fs::exists(file) ? read_entries(file) : json::array();
  for (const json& e : entries) {
    if (e == entry) return;
  }
  entries.push_back(entry);
  util::write_file_atomic(file, entries.dump(2) + "\n");
}

}  // namespace

fs::path run_readers_file(const fs::path& run_dir) { return run_dir / "readers.json"; }

void record_run_reader(const fs::path& run_dir, const std::string& dataset, const Reader& reader) {
  add_entry(run_dir, entry_json(dataset, reader.dataset().dir.string(), reader.manifest().version,
                                reader.options()));
}

void record_run_mixture(const fs::path& run_dir, const Mixture& mixture) {
  add_entry(run_dir, mixture_json(mixture));
}

std::vector<RunReader> run_readers(const fs::path& run_dir) {
  const fs::path file = run_readers_file(run_dir);
  LOOM_CHECK(fs::exists(file), IoError, run_dir.string(),
             " has no readers.json: it is not a run directory, or its program opened no dataset "
             "through Runtime::open_dataset");
  std::vector<RunReader> out;
  for (const json& e : read_entries(file)) {
    try {
      RunReader r;
      r.dataset = e.at("dataset").get<std::string>();
      r.dir = e.at("dir").get<std::string>();
      r.version = e.at("version").get<std::string>();
      r.options = reader_options_from_json(e);
      if (e.contains("mixture")) {
        for (const json& m : e.at("mixture")) {
          r.mixture.push_back({m.at("dataset").get<std::string>(), m.at("dir").get<std::string>(),
                               m.at("version").get<std::string>(), m.at("weight").get<double>(),
                               m.at("epochs") == "stop"});
        }
      }
      out.push_back(std::move(r));
    } catch (const json::exception& ex) {
      throw CorruptData(detail::concat(file.string(), ": reader ", out.size(), " is malformed (",
                                       ex.what(), ")"));
    }
  }
  return out;
}

}  // namespace loom::data
