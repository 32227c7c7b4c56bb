// Real servers on loopback for the remote-dataset tests: Debian's nginx (static files with
// range requests, optionally throttled, killable mid-download), s3rver (an S3-compatible
// server from npm, tools/s3rver/) and an in-process HTTP server that fails on purpose; Debian's
// Prometheus, headless Chromium, and `loom data serve` for the tests of web pages.
#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "util/subprocess.h"

namespace loom::testing {

// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

struct NginxOptions {
  std::string limit_rate;  // per request, nginx syntax ("2m": 2 MiB/s); "": unthrottled
  // Requests served at once at most (nginx limit_conn); more are answered 503. With
  // limit_rate, a fixed bandwidth for the whole server. 0: no limit.
  int max_connections = 0;
};

// nginx serving `root` at url(). Each request is logged; requests() parses the log.
class Nginx {
 public:
  struct Request {
    std::string uri;
    int status = 0;
    std::string range;   // the Range header, "" when none
    uint64_t bytes = 0;  // body bytes sent
  };

  explicit Nginx(std::filesystem::path root, NginxOptions options = {});
  ~Nginx();
  std::string url() const;
  void start();  // (re)starts on the same port and waits until it accepts connections
  void kill();   // SIGKILL, mid-request or not
  std::vector<Request> requests() const;
  // Requests for `uri` that were answered 200 or 206.
  int served(const std::string& uri) const;

 private:
  std::filesystem::path root_;
  NginxOptions options_;
  TempDir dir_{"loom-nginx"};
  int port_;
  std::unique_ptr<util::Subprocess> process_;
};

// s3rver with one bucket, at endpoint(); credentials S3RVER / S3RVER (s3rver's own).
class S3rver {
 public:
  explicit S3rver(std::string bucket);
  ~S3rver();
  std::string endpoint() const;
  // Uploads every file of `dir` to s3://bucket/prefix/<name> with curl (SigV4).
  void upload(const std::filesystem::path& dir, const std::string& prefix);

 private:
  std::string bucket_;
  TempDir dir_{"loom-s3rver"};
  int port_;
  std::unique_ptr<util::Subprocess> process_;
};

// Debian's Prometheus server on loopback, scraping `targets` (host:port) every second at
// /metrics, its data in a temporary directory.
class Prometheus {
 public:
  explicit Prometheus(std::vector<std::string> targets);
  ~Prometheus();
  std::string url() const;
  // An instant query over the HTTP API (/api/v1/query): the "data.result" array of the
  // answer, as JSON text. A failed request or an error status is IoError with the body.
  std::string query(const std::string& expression) const;
  std::string log() const;

 private:
  TempDir dir_{"loom-prometheus"};
  int port_;
  std::unique_ptr<util::Subprocess> process_;
};

// `loom data serve ARGS...` (the build's tools/loom/loom) on a free loopback port, its output
// in `dir`. The constructor waits until /api/dataset answers (30 s; a test failure with the
// output otherwise); the destructor stops it with SIGTERM.
class DataServer {
 public:
  struct Answer {
    int status = 0;
    std::string body;
  };
  DataServer(const TempDir& dir, std::vector<std::string> args,
             std::map<std::string, std::string> env = {}, const std::string& host = "127.0.0.1");
  ~DataServer();
  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;
  std::string url(const std::string& path) const;
  // A GET of `path` on loopback with `headers`; nullopt when nothing answered.
  std::optional<Answer> get(
      const std::string& path,
      const std::vector<std::pair<std::string, std::string>>& headers = {}) const;

 private:
  int port_;
  std::filesystem::path log_;
  std::unique_ptr<util::Subprocess> process_;
};

// Headless Chromium driven over WebDriver (Debian's chromium and chromium-driver): the tests
// of web pages load them in a real browser, run script in the page to read its DOM, and save
// screenshots. available() says whether both programs are installed.
class Browser {
 public:
  static bool available();
  // Starts chromedriver on loopback and opens a session with a window of width x height.
  // Failure is IoError with chromedriver's log.
  explicit Browser(int width = 1400, int height = 1800);
  ~Browser();
  Browser(const Browser&) = delete;
  Browser& operator=(const Browser&) = delete;
  // Navigates to `url` and waits for the page's load event.
  void open(const std::string& url);
  // Runs `script` (a function body; `return` gives the result) in the page; its result as JSON
  // text. A script error is IoError with the browser's message.
  std::string run(const std::string& script);
  // Runs `condition` (an expression) every 100 ms until it is true or `timeout` passed;
  // whether it became true.
  bool wait_for(const std::string& condition, std::chrono::milliseconds timeout);
  // Saves the viewport as a PNG.
  void screenshot(const std::filesystem::path& png);

 private:
  std::string command(const std::string& method, const std::string& path, const std::string& body);
  TempDir dir_{"loom-browser"};
  int port_;
  std::unique_ptr<util::Subprocess> driver_;
  std::string session_;
};

// An HTTP server in this process serving the files of `root`, with ranges, where a fault
// function decides what each request gets. Thread-safe; counts requests per path.
class FaultyServer {
 public:
  enum class Fault {
    kNone,      // the file (or the requested range) as it is
    kStatus,    // an error status (fault.status)
    kTruncate,  // the full Content-Length, but the connection closes after half the body
    kFlipByte,  // the body with one byte changed
  };
  struct Answer {
    Fault fault = Fault::kNone;
    int status = 500;
  };
  // Called with the path and how many requests for it came before this one.
  using Decide = std::function<Answer(const std::string& path, int previous)>;

  FaultyServer(std::filesystem::path root, Decide decide);
  ~FaultyServer();
  std::string url() const;
  int requests(const std::string& path) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::testing
