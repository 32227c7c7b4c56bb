// Test servers: nginx and s3rver as child processes, a faulty HTTP server on a thread.
#include "harness/servers.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "loom/error.h"
#include "util/files.h"

namespace loom::testing {
namespace {

namespace fs = std::filesystem;

bool accepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

void wait_until_accepting(int port, const std::string& what, const fs::path& log) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!accepts(port)) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::string text;
      try {
        text = util::read_file(log);
      } catch (const std::exception&) {
      }
      throw IoError(detail::concat(what, " did not accept connections on 127.0.0.1:", port,
                                   " within 20 s; its log:\n", text));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  LOOM_CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0, IoError,
             "bind to 127.0.0.1:0 failed");
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

DataServer::DataServer(const TempDir& dir, std::vector<std::string> args,
                       std::map<std::string, std::string> env, const std::string& host)
    : port_(free_port()) {
  args.insert(args.begin(), {LOOM_BINARY_DIR "/tools/loom/loom", "data", "serve"});
  args.push_back("--address");
  args.push_back(host + ":" + std::to_string(port_));
  log_ = dir / ("serve_" + std::to_string(port_) + ".out");
  process_ = std::make_unique<util::Subprocess>(
      util::Subprocess::spawn({.argv = args, .env = std::move(env), .output = log_}));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!get("/api/dataset")) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "loom data serve did not start:\n" << util::read_file(log_);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

DataServer::~DataServer() {
  process_->signal(SIGTERM);
  process_->wait();
}

std::string DataServer::url(const std::string& path) const {
  return "http://127.0.0.1:" + std::to_string(port_) + path;
}

std::optional<DataServer::Answer> DataServer::get(
    const std::string& path,
    const std::vector<std::pair<std::string, std::string>>& headers) const {
  httplib::Client client("127.0.0.1", port_);
  client.set_connection_timeout(std::chrono::seconds(2));
  const httplib::Result res = client.Get(path, httplib::Headers(headers.begin(), headers.end()));
  if (!res) return std::nullopt;
  return Answer{res->status, res->body};
}

// ---- Prometheus ----

Prometheus::Prometheus(std::vector<std::string> targets) : port_(free_port()) {
  const fs::path d = dir_.path();
  std::ostringstream conf;
  conf << "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
       << "scrape_configs:\n  - job_name: loom\n    static_configs:\n      - targets: [";
  for (size_t i = 0; i < targets.size(); ++i) conf << (i ? ", " : "") << "'" << targets[i] << "'";
  conf << "]\n";
  std::ofstream(d / "prometheus.yml") << conf.str();
  util::SubprocessOptions o;
  o.argv = {"prometheus", "--config.file=" + (d / "prometheus.yml").string(),
            "--storage.tsdb.path=" + (d / "data").string(),
            "--web.listen-address=127.0.0.1:" + std::to_string(port_)};
  o.output = d / "output.log";
  process_ = std::make_unique<util::Subprocess>(util::Subprocess::spawn(o));
  wait_until_accepting(port_, "prometheus", d / "output.log");
  // It accepts connections before its storage is open, answering 503 until then.
  httplib::Client client(url());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    const auto res = client.Get("/-/ready");
    if (res && res->status == 200) break;
    LOOM_CHECK(std::chrono::steady_clock::now() < deadline, IoError,
               "prometheus was not ready within 30 s; its log:\n", log());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Prometheus::~Prometheus() {
  process_->signal(SIGKILL);
  process_->wait();
}

bool Browser::available() {
  return std::system("command -v chromium >/dev/null && command -v chromedriver >/dev/null") == 0;
}

Browser::Browser(int width, int height) : port_(free_port()) {
  util::SubprocessOptions o;
  o.argv = {"chromedriver", "--port=" + std::to_string(port_), "--allowed-ips=127.0.0.1"};
  o.output = dir_.path() / "chromedriver.log";
  driver_ = std::make_unique<util::Subprocess>(util::Subprocess::spawn(o));
  wait_until_accepting(port_, "chromedriver", *o.output);
  const nlohmann::json args = {
      "--headless=new",
      "--no-sandbox",  // the tests run as root
      "--disable-gpu",
      "--disable-dev-shm-usage",
      "--hide-scrollbars",
      "--user-data-dir=" + (dir_.path() / "profile").string(),
      "--window-size=" + std::to_string(width) + "," + std::to_string(height)};
  const nlohmann::json caps = {
      {"capabilities",
       {{"alwaysMatch",
         {{"browserName", "chrome"},
          {"goog:chromeOptions", {{"binary", "/usr/bin/chromium"}, {"args", args}}}}}}}};
  const auto answer = nlohmann::json::parse(command("POST", "/session", caps.dump()));
  session_ = answer.value("sessionId", "");
  LOOM_CHECK(!session_.empty(), IoError, "chromedriver opened no session: ", answer.dump(),
             "\nchromedriver's log:\n", util::read_file(*o.output));
}

Browser::~Browser() {
  try {
    if (!session_.empty()) command("DELETE", "/session/" + session_, "");
  } catch (const std::exception&) {
  }
  driver_->signal(SIGKILL);
  driver_->wait();
}

std::string Browser::command(const std::string& method, const std::string& path,
                             const std::string& body) {
  httplib::Client client("127.0.0.1", port_);
  client.set_read_timeout(std::chrono::seconds(60));
  const auto res = method == "POST"  ? client.Post(path, body, "application/json")
                   : method == "GET" ? client.Get(path)
                                     : client.Delete(path);
  LOOM_CHECK(res, IoError, "WebDriver ", method, " ", path,
             " failed: ", httplib::to_string(res.error()));
  const auto answer = nlohmann::json::parse(res->body, nullptr, /*allow_exceptions=*/false);
  LOOM_CHECK(res->status == 200 && answer.is_object() && answer.contains("value"), IoError,
             "WebDriver ", method, " ", path, ": status ", res->status, ": ", res->body);
  return answer["value"].dump();
}

void Browser::open(const std::string& url) {
  command("POST", "/session/" + session_ + "/url", nlohmann::json{{"url", url}}.dump());
}

std::string Browser::run(const std::string& script) {
  return command("POST", "/session/" + session_ + "/execute/sync",
                 nlohmann::json{{"script", script}, {"args", nlohmann::json::array()}}.dump());
}

bool Browser::wait_for(const std::string& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (run("return Boolean(" + condition + ");") == "true") return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void Browser::screenshot(const std::filesystem::path& png) {
  const std::string base64 =
      nlohmann::json::parse(command("GET", "/session/" + session_ + "/screenshot", ""));
  std::filesystem::create_directories(png.parent_path());
  std::string bytes;
  uint32_t bits = 0;
  int count = 0;
  for (char c : base64) {
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const char* at = c == 0 ? nullptr : std::strchr(alphabet, c);
    if (at == nullptr) continue;  // '=' padding
    bits = (bits << 6) | static_cast<uint32_t>(at - alphabet);
    count += 6;
    if (count >= 8) {
      count -= 8;
      bytes.push_back(static_cast<char>((bits >> count) & 0xff));
    }
  }
  util::write_file_atomic(png, bytes);
}

std::string Prometheus::url() const { return "http://127.0.0.1:" + std::to_string(port_); }

std::string Prometheus::log() const { return util::read_file(dir_.path() / "output.log"); }

std::string Prometheus::query(const std::string& expression) const {
  httplib::Client client(url());
  const auto res = client.Get("/api/v1/query", {{"query", expression}}, httplib::Headers{});
  LOOM_CHECK(res, IoError, "prometheus query '", expression,
             "' failed: ", httplib::to_string(res.error()));
  LOOM_CHECK(res->status == 200, IoError, "prometheus query '", expression, "': status ",
             res->status, ": ", res->body);
  const auto answer = nlohmann::json::parse(res->body, nullptr, /*allow_exceptions=*/false);
  LOOM_CHECK(answer.is_object() && answer.value("status", "") == "success", IoError,
             "prometheus query '", expression, "' did not succeed: ", res->body);
  return answer["data"]["result"].dump();
}

// ---- Nginx ----

Nginx::Nginx(fs::path root, NginxOptions options)
    : root_(std::move(root)), options_(std::move(options)), port_(free_port()) {
  const fs::path d = dir_.path();
  fs::create_directories(d / "tmp");
  std::ostringstream conf;
  conf << "worker_processes 1;\n"
       << "pid " << (d / "nginx.pid").string() << ";\n"
       << "error_log " << (d / "error.log").string() << ";\n"
       << (::geteuid() == 0 ? "user root;\n" : "") << "events { worker_connections 256; }\n"
       << "http {\n"
       << "  log_format loom '$uri $status \"$http_range\" $body_bytes_sent';\n"
       << "  access_log " << (d / "access.log").string() << " loom;\n";
  if (options_.max_connections > 0) conf << "  limit_conn_zone $server_name zone=all:1m;\n";
  for (const char* t : {"client_body", "proxy", "fastcgi", "uwsgi", "scgi"}) {
    conf << "  " << t << "_temp_path " << (d / "tmp").string() << ";\n";
  }
  conf << "  server {\n"
       << "    listen 127.0.0.1:" << port_ << ";\n"
       << "    root " << root_.string() << ";\n";
  if (!options_.limit_rate.empty()) conf << "    limit_rate " << options_.limit_rate << ";\n";
  if (options_.max_connections > 0) {
    conf << "    limit_conn all " << options_.max_connections << ";\n";
  }
  conf << "  }\n}\n";
  std::ofstream(d / "nginx.conf") << conf.str();
  start();
}

Nginx::~Nginx() { kill(); }

std::string Nginx::url() const { return "http://127.0.0.1:" + std::to_string(port_); }

void Nginx::start() {
  const fs::path d = dir_.path();
  util::SubprocessOptions o;
  o.argv = {"nginx",
            "-p",
            d.string(),
            "-c",
            (d / "nginx.conf").string(),
            "-e",
            (d / "error.log").string(),
            "-g",
            "daemon off;"};
  o.output = d / "output.log";
  process_ = std::make_unique<util::Subprocess>(util::Subprocess::spawn(o));
  wait_until_accepting(port_, "nginx", d / "error.log");
}

void Nginx::kill() {
  if (!process_) return;
  process_->signal(SIGKILL);
  process_->wait();
  process_.reset();
}

std::vector<Nginx::Request> Nginx::requests() const {
  std::vector<Request> out;
  std::ifstream in(dir_.path() / "access.log");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    Request r;
    fields >> r.uri >> r.status;
    const size_t open = line.find('"'), close = line.rfind('"');
    r.range = line.substr(open + 1, close - open - 1);
    if (r.range == "-") r.range.clear();
    r.bytes = std::stoull(line.substr(close + 2));
    out.push_back(r);
  }
  return out;
}

int Nginx::served(const std::string& uri) const {
  int n = 0;
  for (const Request& r : requests()) n += r.uri == uri && (r.status == 200 || r.status == 206);
  return n;
}

// ---- S3rver ----

S3rver::S3rver(std::string bucket) : bucket_(std::move(bucket)), port_(free_port()) {
  const fs::path s3rver =
      fs::path(LOOM_SOURCE_DIR) / "tools/s3rver/node_modules/s3rver/bin/s3rver.js";
  LOOM_CHECK(fs::exists(s3rver), IoError, s3rver.string(),
             " is missing; tools/install-deps.sh installs s3rver from npm");
  fs::create_directories(dir_.path() / "data");
  util::SubprocessOptions o;
  o.argv = {"node",
            s3rver.string(),
            "-d",
            (dir_.path() / "data").string(),
            "-a",
            "127.0.0.1",
            "-p",
            std::to_string(port_),
            "--configure-bucket",
            bucket_,
            "--no-vhost-buckets",
            "-s"};
  o.output = dir_.path() / "s3rver.log";
  process_ = std::make_unique<util::Subprocess>(util::Subprocess::spawn(o));
  wait_until_accepting(port_, "s3rver", dir_.path() / "s3rver.log");
}

S3rver::~S3rver() = default;

std::string S3rver::endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

void S3rver::upload(const fs::path& dir, const std::string& prefix) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string url =
        endpoint() + "/" + bucket_ + "/" + prefix + "/" + entry.path().filename().string();
    ProgramResult r = run_program(
        {"curl", "-sS", "--fail", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "S3RVER:S3RVER",
         "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-T", entry.path().string(), url},
        dir_.path());
    LOOM_CHECK(r.exit_code == 0, IoError, "uploading ", entry.path().string(), " to ", url,
               " failed: ", r.output);
  }
}

// ---- FaultyServer ----

struct FaultyServer::Impl {
  fs::path root;
  Decide decide;
  httplib::Server server;
  std::thread thread;
  int port = 0;
  mutable std::mutex mutex;
  std::map<std::string, int> counts;
};

FaultyServer::FaultyServer(fs::path root, Decide decide) : impl_(std::make_unique<Impl>()) {
  impl_->root = std::move(root);
  impl_->decide = std::move(decide);
  Impl* impl = impl_.get();
  impl_->server.Get(R"(/.*)", [impl](const httplib::Request& req, httplib::Response& res) {
    int previous;
    {
      std::lock_guard<std::mutex> lock(impl->mutex);
      previous = impl->counts[req.path]++;
    }
    const fs::path file = impl->root / req.path.substr(1);
    if (req.path.find("..") != std::string::npos || !fs::is_regular_file(file)) {
      res.status = 404;
      return;
    }
    const Answer answer = impl->decide(req.path, previous);
    if (answer.fault == Fault::kStatus) {
      res.status = answer.status;
      res.set_content("injected failure", "text/plain");
      return;
    }
    auto data = std::make_shared<std::string>(util::read_file(file));
    if (answer.fault == Fault::kFlipByte) (*data)[data->size() / 2] ^= 0x20;
    const bool truncate = answer.fault == Fault::kTruncate;
    res.set_content_provider(
        data->size(), "application/octet-stream",
        [data, truncate](size_t offset, size_t length, httplib::DataSink& sink) {
          if (truncate) {
            sink.write(data->data() + offset, length / 2);
            return false;  // the connection closes mid-body
          }
          sink.write(data->data() + offset, length);
          return true;
        });
  });
  impl_->port = impl_->server.bind_to_any_port("127.0.0.1");
  LOOM_CHECK(impl_->port > 0, IoError, "the faulty HTTP server could not bind");
  impl_->thread = std::thread([impl] { impl->server.listen_after_bind(); });
  while (!impl_->server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

FaultyServer::~FaultyServer() {
  impl_->server.stop();
  impl_->thread.join();
}

std::string FaultyServer::url() const { return "http://127.0.0.1:" + std::to_string(impl_->port); }

int FaultyServer::requests(const std::string& path) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->counts.find(path);
  return it == impl_->counts.end() ? 0 : it->second;
}

}  // namespace loom::testing
