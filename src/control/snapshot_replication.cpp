// SnapshotReplication: an HTTP server over the agent's snapshot memory (an index of its steps
// and ranged file reads) and the thread that copies the predecessor node's committed files.
#include "control/snapshot_replication.h"

#include <fcntl.h>
#include <httplib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "ckpt/manifest.h"
#include "loom/data/remote.h"
#include "loom/error.h"
#include "util/fd.h"
#include "util/files.h"
#include "util/json.h"

namespace loom::control {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kManifest[] = "manifest.json";
constexpr char kTokenHeader[] = "X-Loom-Token";

bool is_partial(const std::string& name) {
  return name.empty() || name[0] == '.' ||
         (name.size() > 5 && name.compare(name.size() - 5, 5, ".part") == 0);
}

}  // namespace

struct SnapshotReplication::Impl {
  // Constant after construction.
  fs::path dir;
  std::string token;
  std::chrono::milliseconds interval;
  std::unique_ptr<data::RemoteClient> client;
  httplib::Server server;
  int port = 0;
  std::string host;
  std::thread serve_thread, pull_thread;

  // Guarded by mutex.
  mutable std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  std::string predecessor, committer;
  std::set<std::pair<int64_t, std::string>> copied;  // (step, file) this agent downloaded
  int64_t done_step = -1;  // the newest step completed since the last follow()
  ReplicationStats stats;

  // {"steps": [{"step": N, "manifest": bytes or -1, "files": {"rank_00001.data": bytes}}]}:
  // this node's steps with the files its own ranks wrote (not those copied from a peer).
  json index() const {
    json steps = json::array();
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::optional<int64_t> step = ckpt::parse_step_dir_name(entry.path().filename());
      if (!step) continue;
      json files = json::object();
      int64_t manifest = -1;
      for (const auto& f : fs::directory_iterator(entry.path(), ec)) {
        const std::string name = f.path().filename().string();
        std::error_code size_ec;
        const auto bytes = fs::file_size(f.path(), size_ec);
        if (size_ec || is_partial(name)) continue;
        if (name == kManifest) {
          manifest = static_cast<int64_t>(bytes);
          continue;
        }
        std::lock_guard<std::mutex> lock(mutex);
        if (!copied.count({*step, name})) files[name] = bytes;
      }
      steps.push_back({{"step", *step}, {"manifest", manifest}, {"files", files}});
    }
    return {{"steps", steps}};
  }

  // GET /files/<step dir>/<file>, with ranges, read from disk in pieces.
  void serve_file(const httplib::Request& req, httplib::Response& res) const {
    const std::string step = req.matches[1], name = req.matches[2];
    if (!ckpt::parse_step_dir_name(step) || is_partial(name) ||
        name.find('/') != std::string::npos || name == "..") {
      res.status = 404;
      return;
    }
    const fs::path path = dir / step / name;
    auto fd = std::make_shared<util::UniqueFd>(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    struct stat st {};
    if (fd->get() < 0 || ::fstat(fd->get(), &st) != 0) {
      res.status = 404;
      return;
    }
    res.set_content_provider(static_cast<size_t>(st.st_size), "application/octet-stream",
                             [fd](size_t offset, size_t length, httplib::DataSink& sink) {
                               std::string buffer(std::min<size_t>(length, size_t{1} << 20), '\0');
                               const ssize_t n = ::pread(fd->get(), buffer.data(), buffer.size(),
                                                         static_cast<off_t>(offset));
                               if (n <= 0) return false;
                               sink.write(buffer.data(), static_cast<size_t>(n));
                               return true;
                             });
  }

  json fetch_index(const std::string& url) const {
    return json::parse(client->get(url + "/index"));
  }

  // Downloads `url` to `target` (bytes long) through a .part beside it.
  void fetch(const std::string& url, const fs::path& target, uint64_t bytes) {
    const fs::path part = target.parent_path() / ("." + target.filename().string() + ".part");
    client->download(url, part, bytes);
    LOOM_CHECK_SYS(::rename(part.c_str(), target.c_str()), "renaming ", part.string());
  }

  // One round: the newest step node 0 committed, completed here from the predecessor.
  void pull_once(const std::string& from, const std::string& manifests) {
    const json committed = manifests.empty() ? index() : fetch_index(manifests);
    const std::string where =
        manifests.empty() ? "this node's snapshot index" : manifests + "/index";
    int64_t newest = -1, manifest_bytes = -1;
    for (const json& s : committed.at("steps")) {
      const auto step = util::integer_field<int64_t>(s.at("step"), "step", where);
      const auto manifest = util::integer_field<int64_t>(s.at("manifest"), "manifest", where);
      if (manifest >= 0 && step > newest) {
        newest = step;
        manifest_bytes = manifest;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (newest < 0 || newest == done_step) return;
    }
    const std::string step_name = ckpt::step_dir_name(newest);
    const fs::path step_dir = dir / step_name;
    const json offered = fetch_index(from);
    for (const json& s : offered.at("steps")) {
      if (util::integer_field<int64_t>(s.at("step"), "step", from + "/index") != newest) continue;
      fs::create_directories(step_dir);
      for (const auto& [name, size] : s.at("files").items()) {
        util::check_plain_file_name(name, from + "/index", "file");
        const auto bytes = util::integer_field<uint64_t>(size, name.c_str(), from + "/index");
        std::error_code ec;
        if (fs::file_size(step_dir / name, ec) == bytes && !ec) continue;
        fetch(from + "/files/" + step_name + "/" + name, step_dir / name, bytes);
        std::lock_guard<std::mutex> lock(mutex);
        copied.insert({newest, name});
        ++stats.files;
        stats.bytes += bytes;
      }
      if (!manifests.empty() && !fs::exists(step_dir / kManifest)) {
        fetch(manifests + "/files/" + step_name + "/" + kManifest, step_dir / kManifest,
              static_cast<uint64_t>(manifest_bytes));
      }
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.steps;
      stats.newest_step = done_step = newest;
      // Forget what retention removed.
      for (auto it = copied.begin(); it != copied.end();) {
        it = fs::exists(dir / ckpt::step_dir_name(it->first)) ? std::next(it) : copied.erase(it);
      }
      return;
    }
  }

  void pull_loop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!stop) {
      wake.wait_for(lock, interval);
      if (stop) return;
      const std::string from = predecessor, manifests = committer;
      if (from.empty()) continue;
      lock.unlock();
      std::string error;
      try {
        pull_once(from, manifests);
      } catch (const std::exception& e) {
        // A peer that is gone, restarting or removing the step: the next round tries again
        // (a lost peer ends its generation, and the agent follows the new one).
        error = e.what();
      }
      lock.lock();
      stats.last_error = error;
    }
  }
};

SnapshotReplication::SnapshotReplication(fs::path dir, const std::string& address,
                                         std::string token, std::chrono::milliseconds interval)
    : impl_(std::make_unique<Impl>()) {
  Impl* impl = impl_.get();
  impl->dir = std::move(dir);
  impl->token = std::move(token);
  impl->interval = interval;
  data::RemoteOptions remote{.attempts = 3,
                             .backoff_s = 0.05,
                             .backoff_max_s = 0.5,
                             .connect_timeout_s = 2,
                             .stall_timeout_s = 10};
  if (!impl->token.empty())
    remote.headers.push_back(std::string(kTokenHeader) + ": " + impl->token);
  impl->client = std::make_unique<data::RemoteClient>(remote);
  if (!impl->token.empty()) {
    impl->server.set_pre_routing_handler(
        [impl](const httplib::Request& req, httplib::Response& res) {
          if (req.get_header_value(kTokenHeader) == impl->token) {
            return httplib::Server::HandlerResponse::Unhandled;
          }
          res.status = 403;
          return httplib::Server::HandlerResponse::Handled;
        });
  }
  impl->server.Get("/index", [impl](const httplib::Request&, httplib::Response& res) {
    res.set_content(impl->index().dump(), "application/json");
  });
  impl->server.Get(
      R"(/files/([^/]+)/([^/]+))",
      [impl](const httplib::Request& req, httplib::Response& res) { impl->serve_file(req, res); });
  impl->host = address;
  impl->port = impl->server.bind_to_any_port(address);
  LOOM_CHECK(impl->port > 0, IoError, "the snapshot replication server cannot listen on ", address,
             "; start `loom run` with --no-snapshots to run without snapshots");
  impl->serve_thread = std::thread([impl] { impl->server.listen_after_bind(); });
  impl->pull_thread = std::thread([impl] { impl->pull_loop(); });
}

SnapshotReplication::~SnapshotReplication() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  impl_->pull_thread.join();
  impl_->server.stop();
  impl_->serve_thread.join();
}

std::string SnapshotReplication::url() const {
  return detail::concat("http://", impl_->host, ":", impl_->port);
}

void SnapshotReplication::follow(const std::string& predecessor, const std::string& committer) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->predecessor = predecessor;
    impl_->committer = committer;
    impl_->done_step = -1;
  }
  impl_->wake.notify_all();
}

ReplicationStats SnapshotReplication::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}

}  // namespace loom::control
