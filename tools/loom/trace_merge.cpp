// `loom trace`'s merge of the ranks' traces (trace_merge.h).
#include "trace_merge.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "loom/error.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// r for "rank_<r>.json", else -1.
int rank_of(const fs::path& file) {
  const std::string name = file.filename().string();
  const std::string prefix = "rank_", suffix = ".json";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 7 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stoi(digits);
}

[[noreturn]] void corrupt(const fs::path& file, const std::string& why) {
  throw CorruptData(detail::concat("trace ", file.string(), " is not a Loom trace: ", why,
                                   ". Delete it, or trace again (metrics.trace_steps)"));
}

const json& field(const json& object, const char* key, const fs::path& file, const char* what) {
  const auto it = object.find(key);
  if (it == object.end()) corrupt(file, detail::concat(what, " has no \"", key, "\""));
  return *it;
}

std::string read_whole(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  LOOM_CHECK(in, IoError, "cannot open the trace ", file.string());
  std::ostringstream text;
  text << in.rdbuf();
  LOOM_CHECK(!in.bad(), IoError, "cannot read the trace ", file.string());
  return text.str();
}

}  // namespace

MergedTrace merge_traces(const fs::path& dir) {
  std::map<int, fs::path> files;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const int rank = rank_of(entry.path());
      if (rank >= 0) files[rank] = entry.path();
    }
  }
  LOOM_CHECK(!files.empty(), IoError, "no traces (rank_<r>.json) in ", dir.string(),
             ": run the job with metrics.trace_steps set (e.g. --metrics.trace_steps=10-12)");

  MergedTrace out;
  std::vector<json> metadata, spans;
  std::set<int64_t> steps;
  for (const auto& [rank, file] : files) {
    json trace;
    try {
      trace = json::parse(read_whole(file));
    } catch (const json::exception& e) {
      corrupt(file, e.what());
    }
    if (!trace.is_object()) corrupt(file, "the file is not a JSON object");
    const json& other = field(trace, "otherData", file, "the file");
    if (!other.is_object() || other.value("format", "") != "loom.trace") {
      corrupt(file, "otherData.format is not \"loom.trace\"");
    }
    const json& file_rank = field(other, "rank", file, "otherData");
    if (!file_rank.is_number_integer() || file_rank.get<int>() != rank) {
      corrupt(file, detail::concat("otherData.rank is ", file_rank.dump(), ", not ", rank));
    }
    const json& offset = field(other, "clock_offset_us", file, "otherData");
    const json& uncertainty = field(other, "clock_uncertainty_us", file, "otherData");
    if (!offset.is_number() || !uncertainty.is_number())
      corrupt(file, "a clock field is not a number");
    const json& file_steps = field(other, "steps", file, "otherData");
    if (!file_steps.is_array()) corrupt(file, "otherData.steps is not a list");
    for (const json& s : file_steps) {
      if (!s.is_number_integer()) corrupt(file, "otherData.steps holds a non-integer");
      steps.insert(s.get<int64_t>());
    }
    out.ranks.push_back(rank);
    out.clock_offsets_us.push_back(offset.get<double>());
    out.clock_uncertainties_us.push_back(uncertainty.get<double>());
    const json& events = field(trace, "traceEvents", file, "the file");
    if (!events.is_array()) corrupt(file, "traceEvents is not a list");
    for (const json& e : events) {
      if (!e.is_object()) corrupt(file, "an event is not an object");
      const json& ph = field(e, "ph", file, "an event");
      if (!ph.is_string()) corrupt(file, "an event's \"ph\" is not a string");
      json event = e;
      event["pid"] = rank;
      if (ph == "M") {
        metadata.push_back(std::move(event));
        continue;
      }
      if (ph != "X") corrupt(file, "an event's \"ph\" is " + ph.dump() + ", not \"X\" or \"M\"");
      const json& ts = field(e, "ts", file, "a span");
      const json& dur = field(e, "dur", file, "a span");
      if (!field(e, "name", file, "a span").is_string() || !ts.is_number() || !dur.is_number() ||
          dur.get<double>() < 0 || !field(e, "tid", file, "a span").is_number_integer()) {
        corrupt(file, "a span's name, ts, dur or tid is not what it should be: " + e.dump());
      }
      event["ts"] = ts.get<double>() + offset.get<double>();
      if (e.value("cat", "") == "step" && e.contains("args") && e["args"].contains("step") &&
          e["args"]["step"].is_number_integer()) {
        out.step_ms[e["args"]["step"].get<int64_t>()][rank] = dur.get<double>() / 1000;
      }
      spans.push_back(std::move(event));
    }
  }
  double origin = std::numeric_limits<double>::infinity(), last = -origin;
  for (const json& e : spans) {
    origin = std::min(origin, e["ts"].get<double>());
    last = std::max(last, e["ts"].get<double>() + e["dur"].get<double>());
  }
  if (spans.empty()) origin = last = 0;
  for (json& e : spans) e["ts"] = e["ts"].get<double>() - origin;
  std::stable_sort(spans.begin(), spans.end(), [](const json& a, const json& b) {
    return a["ts"].get<double>() < b["ts"].get<double>();
  });
  out.spans = spans.size();
  out.steps.assign(steps.begin(), steps.end());
  out.duration_ms = (last - origin) / 1000;

  json events = json::array();
  for (json& e : metadata) events.push_back(std::move(e));
  for (json& e : spans) events.push_back(std::move(e));
  const json merged = {{"traceEvents", std::move(events)},
                       {"displayTimeUnit", "ms"},
                       {"otherData",
                        {{"format", "loom.trace.merged"},
                         {"version", 1},
                         {"ranks", out.ranks},
                         {"steps", out.steps},
                         {"origin_us", static_cast<int64_t>(std::llround(origin))},
                         {"clock_offsets_us", out.clock_offsets_us},
                         {"clock_uncertainties_us", out.clock_uncertainties_us}}}};
  out.json = merged.dump();
  return out;
}

}  // namespace loom::cli
