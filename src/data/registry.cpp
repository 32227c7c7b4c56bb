// DirectoryRegistry (the catalog as a directory tree), build lineage files, and the
// resolution of dataset names for readers.
#include "loom/data/registry.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

#include "loom/error.h"
#include "util/fd.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/json.h"
#include "util/mapped_file.h"

namespace loom::data {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr char kEntryFormat[] = "loom-dataset-version";
constexpr char kLineageFormat[] = "loom-dataset-build";

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Names and tags: letters, digits, '.', '_' and '-', not starting with '.', at most 100 bytes.
void check_name(const std::string& name, const char* role) {
  const bool ok =
      !name.empty() && name.size() <= 100 && name[0] != '.' &&
      std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
      });
  LOOM_CHECK(ok, InvalidArgument, "\"", name, "\" is not a valid dataset ", role,
             ": use letters, digits, '.', '_' and '-' (not starting with '.'), at most 100");
}

// "name@selector" split; a bare name selects "latest".
std::pair<std::string, std::string> split_ref(const std::string& ref) {
  const auto at = ref.find('@');
  if (at == std::string::npos) return {ref, "latest"};
  return {ref.substr(0, at), ref.substr(at + 1)};
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

json source_json(const SourceFile& s) {
  return {{"path", s.path}, {"bytes", s.bytes}, {"xxhash64", util::hash_hex(s.xxhash64)}};
}

json lineage_json(const Lineage& l) {
  json sources = json::array();
  for (const SourceFile& s : l.sources) sources.push_back(source_json(s));
  return {{"sources", sources},
          {"command", l.command},
          {"tokenizer", l.tokenizer},
          {"parent", l.parent}};
}

Lineage parse_lineage(const json& j, const std::string& what) {
  try {
    Lineage l;
    for (const json& s : j.at("sources")) {
      l.sources.push_back({s.at("path").get<std::string>(),
                           util::integer_field<uint64_t>(s.at("bytes"), "bytes", what),
                           util::parse_hash_hex(s.at("xxhash64").get<std::string>(), what)});
    }
    l.command = j.at("command").get<std::string>();
    l.tokenizer = j.at("tokenizer").get<std::string>();
    l.parent = j.at("parent").get<std::string>();
    return l;
  } catch (const json::exception& e) {
    throw CorruptData(detail::concat(what, ": malformed lineage (", e.what(), ")"));
  }
}

json parse_json_file(const fs::path& file) {
  try {
    return json::parse(util::read_file(file));
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw CorruptData(detail::concat(file.string(), " is not valid JSON: ", e.what()));
  }
}

// An exclusive flock held for the object's life.
class FileLock {
 public:
  explicit FileLock(const fs::path& file)
      : fd_(LOOM_CHECK_SYS(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), "opening ",
                           file.string())) {
    while (::flock(fd_.get(), LOCK_EX) == -1) {
      LOOM_CHECK(errno == EINTR, IoError, "cannot lock ", file.string(), ": ",
                 std::strerror(errno));
    }
  }
  ~FileLock() { ::flock(fd_.get(), LOCK_UN); }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  util::UniqueFd fd_;
};

// A local directory made absolute and normal; a URL without its trailing slashes, so that one
// location is recorded one way.
std::string normal_location(const std::string& location) {
  if (!is_remote(location)) return fs::absolute(location).lexically_normal().string();
  std::string url = location;
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return url;
}

// Creates `target` holding `contents` unless it exists: false when it does. The file appears
// complete or not at all (written under a temporary name, fsynced, then linked).
bool create_exclusive(const fs::path& target, const std::string& contents) {
  const fs::path tmp = target.parent_path() /
                       ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()));
  {
    util::UniqueFd fd(
        LOOM_CHECK_SYS(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                       "creating ", tmp.string()));
    util::write_all(fd.get(), contents.data(), contents.size(), tmp);
    LOOM_CHECK_SYS(::fsync(fd.get()), "fsyncing ", tmp.string());
  }
  const int rc = ::link(tmp.c_str(), target.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (rc == -1 && err == EEXIST) return false;
  if (rc == -1) detail::throw_system_error(err, "link", target.string(), __FILE__, __LINE__);
  util::fsync_dir(target.parent_path());
  return true;
}

}  // namespace

// ---- lineage files ----

SourceFile describe_source(const fs::path& path) {
  const fs::path absolute = fs::absolute(path).lexically_normal();
  util::MappedFile file(absolute);
  return {absolute.string(), file.size(), util::xxh64(file.data(), file.size())};
}

Lineage read_build_lineage(const std::string& location, const RemoteOptions& remote) {
  std::string name, text;
  if (is_remote(location)) {
    name = join_url(location, kBuildLineageFile);
    try {
      text = RemoteClient(remote).get(name);
    } catch (const RemoteError& e) {
      if (e.status() == 404) return {};  // built without lineage, or uploaded without it
      throw;
    }
  } else {
    const fs::path file = fs::path(location) / kBuildLineageFile;
    if (!fs::exists(file)) return {};
    name = file.string();
    text = util::read_file(file);
  }
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw CorruptData(detail::concat(name, " is not valid JSON: ", e.what()));
  }
  LOOM_CHECK(j.is_object() && j.value("format", "") == kLineageFormat, CorruptData, name,
             " is not a Loom build lineage file");
  return parse_lineage(j, name);
}

void write_build_lineage(const fs::path& dir, const Lineage& lineage) {
  json j = lineage_json(lineage);
  j["format"] = kLineageFormat;
  j["format_version"] = 1;
  util::write_file_atomic(dir / kBuildLineageFile, j.dump(2) + "\n");
}

// ---- DirectoryRegistry ----

DirectoryRegistry::DirectoryRegistry(fs::path root) : root_(std::move(root)) {}

std::vector<uint64_t> DirectoryRegistry::numbers(const std::string& name) const {
  std::vector<uint64_t> out;
  const fs::path dir = root_ / name / "versions";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.size() > 5 && file.compare(file.size() - 5, 5, ".json") == 0 &&
        all_digits(file.substr(0, file.size() - 5)) && file.size() < 25) {
      out.push_back(std::stoull(file.substr(0, file.size() - 5)));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

DatasetVersion DirectoryRegistry::read_version(const std::string& name, uint64_t number) const {
  const fs::path file = root_ / name / "versions" / (std::to_string(number) + ".json");
  const json j = parse_json_file(file);
  DatasetVersion v;
  try {
    LOOM_CHECK(j.at("format").get<std::string>() == kEntryFormat, CorruptData, file.string(),
               " is not a Loom registry entry");
    v.name = j.at("name").get<std::string>();
    v.number = util::integer_field<uint64_t>(j.at("version"), "version", file.string());
    v.content_version = j.at("content_version").get<std::string>();
    v.dir = j.at("dir").get<std::string>();
    v.kind =
        j.at("kind").get<std::string>() == "tokens" ? DatasetKind::kTokens : DatasetKind::kRecords;
    v.bytes = util::integer_field<uint64_t>(j.at("bytes"), "bytes", file.string());
    v.items = util::integer_field<uint64_t>(j.at("items"), "items", file.string());
    v.registered_at = j.at("registered_at").get<std::string>();
    v.lineage = parse_lineage(j.at("lineage"), file.string());
  } catch (const json::exception& e) {
    throw CorruptData(detail::concat(file.string(), ": malformed registry entry (", e.what(), ")"));
  }
  LOOM_CHECK(v.name == name && v.number == number, CorruptData, file.string(), " records ", v.ref(),
             "; it is the entry of ", name, "@", number);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_ / name / "tags", ec)) {
    const std::string tag = entry.path().filename().string();
    if (tag[0] == '.') continue;
    if (util::read_file(entry.path()) == std::to_string(number) + "\n") v.tags.push_back(tag);
  }
  std::sort(v.tags.begin(), v.tags.end());
  return v;
}

std::vector<std::string> DirectoryRegistry::names() const {
  LOOM_CHECK(fs::is_directory(root_), IoError, "dataset registry ", root_.string(),
             " does not exist; `loom data register` creates it");
  std::vector<std::string> out;
  for (const auto& entry : fs::directory_iterator(root_)) {
    const std::string name = entry.path().filename().string();
    if (name[0] != '.' && fs::is_directory(entry.path() / "versions")) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<DatasetVersion> DirectoryRegistry::versions(const std::string& name) const {
  get(name + "@latest");  // the errors for an unknown name
  std::vector<DatasetVersion> out;
  for (uint64_t n : numbers(name)) out.push_back(read_version(name, n));
  return out;
}

DatasetVersion DirectoryRegistry::get(const std::string& ref) const {
  const auto [name, selector] = split_ref(ref);
  check_name(name, "name");
  const std::vector<uint64_t> have = numbers(name);
  if (have.empty()) {
    std::string known;
    if (fs::is_directory(root_)) {
      for (const std::string& n : names()) known += (known.empty() ? "" : ", ") + n;
    }
    throw InvalidArgument(detail::concat(
        "no dataset named \"", name, "\" in the registry ", root_.string(),
        known.empty() ? " (it is empty)" : "", known.empty() ? "" : "; it has: ", known,
        ". Register one with `loom data register ", name, " DIR`"));
  }
  const std::string range = detail::concat(name, " has versions 1 to ", have.back());
  if (selector == "latest") return read_version(name, have.back());
  if (all_digits(selector)) {
    const uint64_t n = selector.size() < 20 ? std::stoull(selector) : 0;
    LOOM_CHECK(std::binary_search(have.begin(), have.end(), n), InvalidArgument, "dataset ", ref,
               " does not exist: ", range, " in the registry ", root_.string());
    return read_version(name, n);
  }
  check_name(selector, "tag");
  const fs::path tag_file = root_ / name / "tags" / selector;
  LOOM_CHECK(fs::exists(tag_file), InvalidArgument, "dataset ", name, " has no version or tag \"",
             selector, "\" (", range, "); tag one with `loom data tag ", name, "@N ", selector,
             "`");
  std::string text = util::read_file(tag_file);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  LOOM_CHECK(all_digits(text) && text.size() < 20 &&
                 std::binary_search(have.begin(), have.end(), std::stoull(text)),
             InvalidArgument, "tag ", ref, " points nowhere: it names version \"", text, "\" but ",
             range, " (", tag_file.string(), "); move it with `loom data tag ", name, "@N ",
             selector, "`");
  return read_version(name, std::stoull(text));
}

DatasetVersion DirectoryRegistry::add(const std::string& name, const std::string& location,
                                      const RegisterOptions& options) {
  check_name(name, "name");
  const std::string where = normal_location(location);
  const Manifest m = read_manifest(where, options.remote);
  // A remote dataset's tokenizer files are checked by the readers that download them.
  if (!is_remote(where)) check_tokenizer_files(where, m);
  DatasetVersion v;
  v.name = name;
  v.content_version = m.version;
  v.dir = where;
  v.kind = m.kind;
  v.bytes = m.total_bytes();
  v.items = m.total_items();
  v.registered_at = utc_now();
  v.lineage = read_build_lineage(where, options.remote);
  if (!options.parent.empty()) v.lineage.parent = get(options.parent).ref();

  const fs::path base = root_ / name;
  std::error_code ec;
  fs::create_directories(base / "versions", ec);
  LOOM_CHECK(!ec, IoError, "cannot create ", (base / "versions").string(), ": ", ec.message());
  fs::create_directories(base / "tags", ec);
  LOOM_CHECK(!ec, IoError, "cannot create ", (base / "tags").string(), ": ", ec.message());
  const FileLock lock(base / ".lock");
  std::vector<uint64_t> have = numbers(name);
  if (!have.empty()) {
    const DatasetVersion latest = read_version(name, have.back());
    if (latest.content_version == v.content_version && latest.dir == v.dir) return latest;
    if (options.parent.empty()) v.lineage.parent = latest.ref();
  }
  for (v.number = have.empty() ? 1 : have.back() + 1;; ++v.number) {
    json j = {{"format", kEntryFormat},
              {"format_version", 1},
              {"name", v.name},
              {"version", v.number},
              {"content_version", v.content_version},
              {"dir", v.dir.string()},
              {"kind", v.kind == DatasetKind::kTokens ? "tokens" : "records"},
              {"bytes", v.bytes},
              {"items", v.items},
              {"registered_at", v.registered_at},
              {"lineage", lineage_json(v.lineage)}};
    const fs::path file = base / "versions" / (std::to_string(v.number) + ".json");
    if (create_exclusive(file, j.dump(2) + "\n")) return v;
  }
}

void DirectoryRegistry::tag(const std::string& ref, const std::string& tag) {
  check_name(tag, "tag");
  LOOM_CHECK(tag != "latest" && !all_digits(tag), InvalidArgument, "\"", tag,
             "\" cannot be a tag: \"latest\" and numbers already select versions");
  const DatasetVersion v = get(ref);
  util::write_file_atomic(root_ / v.name / "tags" / tag, std::to_string(v.number) + "\n");
}

// ---- resolution ----

std::unique_ptr<Registry> open_registry(const fs::path& root) {
  fs::path where = root;
  if (where.empty()) {
    const char* env = std::getenv("LOOM_DATA_REGISTRY");
    if (env != nullptr) where = env;
  }
  LOOM_CHECK(!where.empty(), InvalidArgument,
             "no dataset registry is set: set LOOM_DATA_REGISTRY to its directory (or pass "
             "--registry DIR)");
  return std::make_unique<DirectoryRegistry>(where);
}

bool is_registry_name(const std::string& spec) {
  std::error_code ec;
  return !spec.empty() && spec.find('/') == std::string::npos && !fs::exists(spec, ec);
}

ResolvedDataset resolve_dataset(const std::string& spec, const fs::path& registry_root,
                                const RemoteOptions& remote) {
  if (!is_registry_name(spec)) return {spec, "", ""};
  std::unique_ptr<Registry> registry;
  try {
    registry = open_registry(registry_root);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::concat("dataset \"", spec,
                                         "\" is not a directory, and it cannot be looked up as a "
                                         "registry name: ",
                                         e.what()));
  }
  const DatasetVersion v = registry->get(spec);
  const std::string where = v.dir.string();
  Manifest m;
  if (is_remote(where)) {
    try {
      m = read_manifest(where, remote);
    } catch (const RemoteError& e) {
      throw RemoteError(
          e.url(), e.status(), e.attempts(),
          detail::concat("dataset ", v.ref(), " is registered at ", where, ": ", e.what()));
    }
  } else {
    LOOM_CHECK(fs::is_directory(v.dir), IoError, "dataset ", v.ref(), " is registered at ", where,
               ", which no longer exists; restore it, or register its new place as "
               "a new version");
    m = read_manifest(v.dir);
  }
  LOOM_CHECK(m.version == v.content_version || m.previous_version == v.content_version, CorruptData,
             "dataset ", v.ref(), " was registered with content version ", v.content_version,
             " but ", where, " now holds version ", m.version,
             ": its files changed since registration. Restore them, or register the new content "
             "as a new version (`loom data register ",
             v.name, " ", where, "`)");
  return {v.dir, v.ref(), v.content_version};
}

}  // namespace loom::data
