// The checkpoint manifest's JSON form, merging of the ranks' reports, step directory names.
#include "ckpt/manifest.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "ckpt/storage.h"
#include "loom/error.h"
#include "util/dtype.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/json.h"

namespace loom::ckpt {
namespace {

using nlohmann::json;

template <typename T>
T integer(const json& j, const char* key, const std::string& what) {
  return util::integer_field<T>(j.at(key), key, what);
}

json piece_to_json(const Piece& p) {
  json chunks = json::array();
  for (uint64_t h : p.chunk_hashes) chunks.push_back(util::hash_hex(h));
  return {{"file", p.file},
          {"begin", p.begin},
          {"end", p.end},
          {"offset", p.offset},
          {"bytes", p.bytes},
          {"xxh64", util::hash_hex(p.hash)},
          {"chunk_bytes", p.chunk_bytes},
          {"chunk_xxh64", chunks}};
}

Piece piece_from_json(const json& j, const std::string& what) {
  Piece p;
  p.file = j.at("file").get<std::string>();
  util::check_plain_file_name(p.file, what, "data file name");
  p.begin = integer<int64_t>(j, "begin", what);
  p.end = integer<int64_t>(j, "end", what);
  p.offset = integer<uint64_t>(j, "offset", what);
  p.bytes = integer<uint64_t>(j, "bytes", what);
  p.hash = util::parse_hash_hex(j.at("xxh64").get<std::string>(), what);
  p.chunk_bytes = integer<uint64_t>(j, "chunk_bytes", what);
  for (const auto& h : j.at("chunk_xxh64"))
    p.chunk_hashes.push_back(util::parse_hash_hex(h.get<std::string>(), what));
  const uint64_t expected_chunks =
      p.chunk_bytes == 0 ? 0 : p.bytes / p.chunk_bytes + (p.bytes % p.chunk_bytes != 0);
  LOOM_CHECK(p.begin >= 0 && p.begin <= p.end && p.chunk_bytes > 0 &&
                 p.chunk_hashes.size() == expected_chunks,
             CorruptData, what, ": a piece of file ", p.file, " has inconsistent ranges or hashes");
  return p;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// The numbers a reader trusts: a known dtype, a shape whose element count fits int64, and
// pieces inside the tensor whose byte counts match their element ranges (the reader indexes
// chunk hashes and sizes reads by them). CorruptData naming `what` and the tensor otherwise.
void check_tensor_record(const TensorRecord& r, const std::string& what) {
  uint64_t es = 0;
  try {
    es = c10::elementSize(parse_dtype(r.dtype));
  } catch (const CorruptData& e) {
    throw CorruptData(detail::concat(what, ", tensor ", r.name, ": ", e.what()));
  }
  int64_t numel = 1;
  for (int64_t d : r.shape) {
    LOOM_CHECK(d >= 0 && (d == 0 || numel <= INT64_MAX / d), CorruptData, what, ", tensor ", r.name,
               ": shape ", shape_text(r.shape), " is negative or too large");
    numel *= d;
  }
  LOOM_CHECK(static_cast<uint64_t>(numel) <= UINT64_MAX / es, CorruptData, what, ", tensor ",
             r.name, ": shape ", shape_text(r.shape), " is too large");
  for (const Piece& p : r.pieces) {
    LOOM_CHECK(p.end <= numel && p.bytes == static_cast<uint64_t>(p.end - p.begin) * es &&
                   p.chunk_bytes % es == 0 && p.offset <= UINT64_MAX - p.bytes,
               CorruptData, what, ", tensor ", r.name, ": the piece [", p.begin, ", ", p.end,
               ") of file ", p.file, " claims ", p.bytes, " bytes at offset ", p.offset,
               " in chunks of ", p.chunk_bytes, "; a ", r.dtype, " tensor of ", numel,
               " elements cannot hold that (the manifest is corrupt)");
  }
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.size() < 13 || name.rfind("step_", 0) != 0) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string data_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.data", rank);
  return name;
}

std::string dtype_name(c10::ScalarType type) {
  LOOM_CHECK(util::is_named_dtype(type), InvalidArgument,
             "checkpoints cannot hold tensors of dtype ", util::dtype_name(type), "; they hold ",
             util::dtype_names());
  return util::dtype_name(type);
}

c10::ScalarType parse_dtype(const std::string& name) {
  const std::optional<c10::ScalarType> type = util::dtype_of(name);
  LOOM_CHECK(type.has_value(), CorruptData, "unknown dtype \"", name,
             "\" in a checkpoint manifest");
  return *type;
}

uint64_t piece_hash(const std::vector<uint64_t>& chunk_hashes) {
  std::string words;
  words.reserve(chunk_hashes.size() * 8);
  for (uint64_t h : chunk_hashes)
    for (int byte = 0; byte < 8; ++byte) words.push_back(static_cast<char>(h >> (8 * byte)));
  return util::xxh64(words);
}

int64_t TensorRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorRecord* Manifest::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

uint64_t Manifest::data_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files) total += f.bytes;
  return total;
}

std::string to_json(const Manifest& m) {
  json files = json::array();
  for (const auto& f : m.files)
    files.push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}});
  json tensors = json::array();
  for (const auto& t : m.tensors) {
    json pieces = json::array();
    for (const auto& p : t.pieces) pieces.push_back(piece_to_json(p));
    tensors.push_back({{"name", t.name},
                       {"dtype", t.dtype},
                       {"shape", t.shape},
                       {"kind", t.kind},
                       {"pieces", pieces}});
  }
  json blobs = json::object();
  for (const auto& [name, text] : m.blobs) blobs[name] = json::parse(text);
  json out = {{"format", "loom-checkpoint"},
              {"version", kManifestVersion},
              {"step", m.step},
              {"world_size", m.world_size},
              {"files", files},
              {"tensors", tensors},
              {"blobs", blobs}};
  return out.dump(1);
}

Manifest parse_manifest(const std::string& text, const std::string& what) {
  try {
    json j = json::parse(text);
    LOOM_CHECK(j.at("format") == "loom-checkpoint", CorruptData, what,
               " is not a Loom checkpoint manifest");
    LOOM_CHECK(j.at("version") == kManifestVersion, CorruptData, what, " has manifest version ",
               j.at("version").dump(), "; this Loom reads version ", kManifestVersion);
    Manifest m;
    m.step = integer<int64_t>(j, "step", what);
    m.world_size = integer<int>(j, "world_size", what);
    for (const auto& f : j.at("files")) {
      m.files.push_back({f.at("name").get<std::string>(), integer<int>(f, "rank", what),
                         integer<uint64_t>(f, "bytes", what)});
      util::check_plain_file_name(m.files.back().name, what, "data file name");
    }
    for (const auto& t : j.at("tensors")) {
      TensorRecord r;
      r.name = t.at("name").get<std::string>();
      r.dtype = t.at("dtype").get<std::string>();
      const json& shape = t.at("shape");
      LOOM_CHECK(shape.is_array(), CorruptData, what, ": tensor ", r.name,
                 ": \"shape\" is not an array");
      for (size_t d = 0; d < shape.size(); ++d)
        r.shape.push_back(util::integer_field<int64_t>(shape[d], "shape", what));
      r.kind = t.at("kind").get<std::string>();
      for (const auto& p : t.at("pieces"))
        r.pieces.push_back(piece_from_json(p, detail::concat(what, ", tensor ", r.name)));
      check_tensor_record(r, what);
      m.tensors.push_back(std::move(r));
    }
    for (const auto& [name, value] : j.at("blobs").items()) m.blobs[name] = value.dump();
    return m;
  } catch (const json::exception& e) {
    throw CorruptData(detail::concat(what, " is not a valid manifest: ", e.what()));
  }
}

Manifest read_manifest(Storage& storage, const std::filesystem::path& step_dir) {
  const auto path = step_dir / kManifestName;
  auto file = storage.open(path);
  std::string text(file->size(), '\0');
  LOOM_CHECK(read_exact(*file, 0, text.data(), text.size()), IoError, "reading ", path,
             ": the file ended early (it changed while being read)");
  return parse_manifest(text, path.string());
}

Manifest read_manifest(const std::filesystem::path& step_dir) {
  return read_manifest(*posix_storage(), step_dir);
}

Manifest merge_reports(int64_t step, const std::vector<Manifest>& reports) {
  Manifest m;
  m.step = step;
  m.world_size = static_cast<int>(reports.size());
  std::map<std::string, size_t> index;    // name -> position in m.tensors
  std::map<std::string, int> first_rank;  // name -> the rank that described it first
  for (size_t r = 0; r < reports.size(); ++r) {
    const Manifest& report = reports[r];
    m.files.insert(m.files.end(), report.files.begin(), report.files.end());
    if (r == 0) m.blobs = report.blobs;
    for (const auto& t : report.tensors) {
      auto [it, inserted] = index.emplace(t.name, m.tensors.size());
      if (inserted) {
        m.tensors.push_back(t);
        first_rank[t.name] = static_cast<int>(r);
        continue;
      }
      TensorRecord& merged = m.tensors[it->second];
      LOOM_CHECK(merged.dtype == t.dtype && merged.shape == t.shape && merged.kind == t.kind,
                 InvalidArgument, "step ", step, ": tensor \"", t.name, "\" is ", t.dtype, " ",
                 shape_text(t.shape), " (", t.kind, ") on rank ", r, " but ", merged.dtype, " ",
                 shape_text(merged.shape), " (", merged.kind, ") on rank ", first_rank[t.name],
                 "; every rank must describe the same global tensor");
      merged.pieces.insert(merged.pieces.end(), t.pieces.begin(), t.pieces.end());
    }
  }
  for (auto& t : m.tensors) {
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    int64_t covered = 0;
    for (const auto& p : t.pieces) {
      LOOM_CHECK(p.begin <= covered, InvalidArgument, "step ", step, ": no rank holds elements [",
                 covered, ", ", p.begin, ") of tensor \"", t.name,
                 "\"; the ranks' shardings must cover the whole tensor");
      covered = std::max(covered, p.end);
    }
    LOOM_CHECK(covered >= t.numel(), InvalidArgument, "step ", step, ": no rank holds elements [",
               covered, ", ", t.numel(), ") of tensor \"", t.name,
               "\"; the ranks' shardings must cover the whole tensor");
  }
  return m;
}

namespace {

struct StepDir {
  int64_t step;
  std::string name;
  bool committed;  // holds a manifest
  bool operator<(const StepDir& other) const { return step < other.step; }
};

// Step directories under dir, ascending by step.
std::vector<StepDir> step_dirs(Storage& storage, const std::filesystem::path& dir) {
  std::vector<StepDir> steps;
  for (const std::string& name : storage.list(dir)) {
    if (auto step = parse_step_dir_name(name))
      steps.push_back({*step, name, storage.exists(dir / name / kManifestName)});
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace

std::vector<int64_t> committed_steps(Storage& storage, const std::filesystem::path& dir) {
  std::vector<int64_t> steps;
  for (const StepDir& d : step_dirs(storage, dir))
    if (d.committed) steps.push_back(d.step);
  return steps;
}

std::vector<int64_t> committed_steps(const std::filesystem::path& dir) {
  return committed_steps(*posix_storage(), dir);
}

std::vector<std::filesystem::path> uncommitted_dirs(Storage& storage,
                                                    const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> dirs;
  for (const StepDir& d : step_dirs(storage, dir))
    if (!d.committed) dirs.push_back(dir / d.name);
  return dirs;
}

std::vector<std::filesystem::path> uncommitted_dirs(const std::filesystem::path& dir) {
  return uncommitted_dirs(*posix_storage(), dir);
}

}  // namespace loom::ckpt
