// RemoteClient: libcurl requests with retries (full-jitter backoff), resumed range downloads,
// and S3 SigV4 signing (libcurl's CURLOPT_AWS_SIGV4).
#include "loom/data/remote.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "data/manifest.h"
#include "data/shard_format.h"
#include "util/fd.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

std::string env_or(const char* a, const char* b = nullptr) {
  if (const char* v = std::getenv(a); v && *v) return v;
  if (b) {
    if (const char* v = std::getenv(b); v && *v) return v;
  }
  return "";
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// Statuses worth another try: the server is overloaded, throttling, or failed this once.
bool retryable_status(long status) { return status == 408 || status == 429 || status >= 500; }

bool retryable_code(CURLcode code) {
  switch (code) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

// What one attempt saw.
struct Response {
  CURLcode code = CURLE_OK;
  long status = 0;
  std::string curl_error;
  std::string error_body;  // the start of a non-2xx body (S3 puts its error code there)
};

// An attempt's body goes to `sink` when the status is 2xx, else (its start) into error_body.
struct Transfer {
  CURL* curl;
  Response* response;
  std::function<bool(const char*, size_t, long status)> sink;  // false: abort the transfer
};

size_t on_body(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = size * n;
  long status = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
  if (status < 200 || status >= 300) {
    std::string& body = t->response->error_body;
    body.append(data, std::min<size_t>(bytes, 4096 - std::min<size_t>(4096, body.size())));
    return bytes;
  }
  return t->sink(data, bytes, status) ? bytes : 0;
}

// "NoSuchKey" out of an S3 error body, or "".
std::string s3_code(const std::string& body) {
  const size_t b = body.find("<Code>"), e = body.find("</Code>");
  if (b == std::string::npos || e == std::string::npos || e < b) return "";
  return body.substr(b + 6, e - b - 6);
}

}  // namespace

bool is_remote(std::string_view location) {
  return starts_with(location, "http://") || starts_with(location, "https://") ||
         starts_with(location, "s3://");
}

std::string join_url(const std::string& base, const std::string& name) {
  if (!base.empty() && base.back() == '/') return base + name;
  return base + "/" + name;
}

struct RemoteClient::Impl {
  RemoteOptions options;
  mutable std::atomic<uint64_t> requests{0}, retries{0}, bytes{0};

  // One request: GET `url` with `Range: bytes=begin-` when begin > 0.
  Response perform(const std::string& url, uint64_t begin,
                   const std::function<bool(const char*, size_t, long)>& sink) const {
    Response r;
    CURL* curl = curl_easy_init();
    LOOM_CHECK(curl != nullptr, IoError, "curl_easy_init failed for ", url);
    char error[CURL_ERROR_SIZE] = {0};
    Transfer transfer{curl, &r, sink};
    const std::string http = http_url_of(url);
    curl_slist* headers = nullptr;
    curl_easy_setopt(curl, CURLOPT_URL, http.c_str());
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(curl, CURLOPT_MAXREDIRS, 5L);
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(options.connect_timeout_s * 1000));
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                     std::max(1L, static_cast<long>(options.stall_timeout_s)));
    if (!options.ca_file.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, options.ca_file.c_str());
    const std::string range = std::to_string(begin) + "-";
    if (begin > 0) curl_easy_setopt(curl, CURLOPT_RANGE, range.c_str());
    const std::string sigv4 = "aws:amz:" + options.s3_region + ":s3";
    const std::string user = options.access_key_id + ":" + options.secret_access_key;
    if (starts_with(url, "s3://") && !options.access_key_id.empty()) {
      curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
      curl_easy_setopt(curl, CURLOPT_USERPWD, user.c_str());
      headers = curl_slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
      if (!options.session_token.empty()) {
        headers =
            curl_slist_append(headers, ("x-amz-security-token: " + options.session_token).c_str());
      }
    }
    for (const std::string& h : options.headers) headers = curl_slist_append(headers, h.c_str());
    if (headers != nullptr) curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    r.code = curl_easy_perform(curl);
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &r.status);
    r.curl_error = error[0] ? error : curl_easy_strerror(r.code);
    curl_slist_free_all(headers);
    curl_easy_cleanup(curl);
    requests.fetch_add(1, std::memory_order_relaxed);
    return r;
  }

  std::string http_url_of(const std::string& url) const {
    if (!starts_with(url, "s3://")) return url;
    const std::string rest = url.substr(5);
    const size_t slash = rest.find('/');
    const std::string bucket = rest.substr(0, slash);
    const std::string key = slash == std::string::npos ? "" : rest.substr(slash + 1);
    if (options.s3_endpoint.empty()) {
      return "https://" + bucket + ".s3." + options.s3_region + ".amazonaws.com/" + key;
    }
    return join_url(join_url(options.s3_endpoint, bucket), key);
  }

  // Sleeps before retry `k` (1, 2, ...): full jitter over an exponentially growing window.
  void back_off(int k) const {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const double window = std::min(options.backoff_max_s, options.backoff_s * std::ldexp(1.0, k));
    std::uniform_real_distribution<double> delay(0.0, window);
    std::this_thread::sleep_for(std::chrono::duration<double>(delay(rng)));
    retries.fetch_add(1, std::memory_order_relaxed);
  }

  // Throws the error that ends the request. `what` says what was asked for.
  [[noreturn]] void fail(const std::string& url, const Response& r, int attempts,
                         const std::string& what) const {
    std::string reason;
    if (r.code != CURLE_OK && r.status == 0) {
      reason = r.curl_error;
    } else {
      reason = "HTTP " + std::to_string(r.status);
      const std::string code = s3_code(r.error_body);
      if (!code.empty()) reason += " " + code;
      if (r.code != CURLE_OK) reason += ", then " + r.curl_error;
    }
    std::string advice;
    if (r.status == 404) {
      advice = "; it does not exist: check the URL and that the dataset was uploaded whole";
    } else if (r.status == 401 || r.status == 403) {
      advice =
          "; the credentials were refused: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
          "(or the URL's access)";
    } else {
      advice = "; gave up after " + std::to_string(attempts) +
               (attempts == 1 ? " attempt" : " attempts") + " (RemoteOptions::attempts)";
    }
    throw RemoteError(url, r.status, attempts,
                      detail::concat(what, " ", url, " failed: ", reason, advice));
  }

  // Whether a failed attempt is worth repeating.
  static bool retryable(const Response& r) {
    if (r.status >= 200 && r.status < 300) return r.code != CURLE_OK && retryable_code(r.code);
    if (r.status != 0) return retryable_status(r.status);
    return retryable_code(r.code);
  }
};

RemoteClient::RemoteClient(RemoteOptions options) : impl_(std::make_unique<Impl>()) {
  global_init();
  if (options.s3_endpoint.empty())
    options.s3_endpoint = env_or("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL");
  if (options.s3_region.empty()) options.s3_region = env_or("AWS_REGION", "AWS_DEFAULT_REGION");
  if (options.s3_region.empty()) options.s3_region = "us-east-1";
  if (options.access_key_id.empty()) options.access_key_id = env_or("AWS_ACCESS_KEY_ID");
  if (options.secret_access_key.empty()) {
    options.secret_access_key = env_or("AWS_SECRET_ACCESS_KEY");
  }
  if (options.session_token.empty()) options.session_token = env_or("AWS_SESSION_TOKEN");
  LOOM_CHECK(options.attempts >= 1, InvalidArgument, "RemoteOptions::attempts must be >= 1, got ",
             options.attempts);
  impl_->options = std::move(options);
}

RemoteClient::~RemoteClient() = default;

const RemoteOptions& RemoteClient::options() const { return impl_->options; }
std::string RemoteClient::http_url(const std::string& url) const { return impl_->http_url_of(url); }

RemoteStats RemoteClient::stats() const {
  return {impl_->requests.load(), impl_->retries.load(), impl_->bytes.load()};
}

std::string RemoteClient::get(const std::string& url) const {
  constexpr size_t kMaxBytes = size_t{1} << 30;
  for (int attempt = 1;; ++attempt) {
    std::string body;
    Response r = impl_->perform(url, 0, [&](const char* data, size_t n, long) {
      if (body.size() + n > kMaxBytes) return false;
      body.append(data, n);
      return true;
    });
    impl_->bytes.fetch_add(body.size(), std::memory_order_relaxed);
    if (r.code == CURLE_OK && r.status >= 200 && r.status < 300) return body;
    if (attempt >= impl_->options.attempts || !Impl::retryable(r)) {
      impl_->fail(url, r, attempt, "fetching");
    }
    impl_->back_off(attempt);
  }
}

void RemoteClient::download(const std::string& url, const fs::path& path, uint64_t bytes) const {
  util::UniqueFd fd(LOOM_CHECK_SYS(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644),
                                   "opening ", path.string()));
  struct stat st {};
  LOOM_CHECK_SYS(::fstat(fd.get(), &st), "stat of ", path.string());
  uint64_t have = static_cast<uint64_t>(st.st_size);
  if (have > bytes) {
    LOOM_CHECK_SYS(::ftruncate(fd.get(), 0), "truncating ", path.string());
    have = 0;
  }
  // Attempts count the failures in a row without progress: a download that keeps moving
  // through a flaky connection is not given up on.
  int failures = 0;
  while (have < bytes) {
    const uint64_t begin = have;
    bool restarted = false, oversize = false;
    Response r = impl_->perform(url, begin, [&](const char* data, size_t n, long status) {
      if (status != 206 && begin > 0 && !restarted) {
        // The server ignored the range and sends the whole object: start over.
        restarted = true;
        have = 0;
        if (::ftruncate(fd.get(), 0) != 0) return false;
      }
      if (have + n > bytes) {
        oversize = true;
        return false;
      }
      size_t done = 0;
      while (done < n) {
        const ssize_t w =
            ::pwrite(fd.get(), data + done, n - done, static_cast<off_t>(have + done));
        if (w < 0) {
          if (errno == EINTR) continue;
          return false;
        }
        done += static_cast<size_t>(w);
      }
      have += n;
      impl_->bytes.fetch_add(n, std::memory_order_relaxed);
      return true;
    });
    const bool ok_status = r.status >= 200 && r.status < 300;
    if (oversize) {
      throw CorruptData(detail::concat(url, " is longer than the ", bytes,
                                       " bytes the manifest records: the remote copy is not "
                                       "this dataset's; upload the dataset again"));
    }
    if (r.status == 416) {
      throw CorruptData(detail::concat(url, " is shorter than the ", bytes,
                                       " bytes the manifest records (HTTP 416 for a range from ",
                                       begin, "); upload the dataset again"));
    }
    if (r.code == CURLE_WRITE_ERROR && ok_status) {
      throw IoError(detail::concat("writing ", path.string(), " failed while downloading ", url,
                                   ": ", std::strerror(errno)));
    }
    const bool progressed = have > begin || restarted;
    if (r.code == CURLE_OK && ok_status) {
      if (have == bytes) break;
      // A body that ended early without an error (a short Content-Length): resume.
      r.code = CURLE_PARTIAL_FILE;
    }
    failures = progressed ? 1 : failures + 1;
    if (failures >= impl_->options.attempts || !Impl::retryable(r)) {
      impl_->fail(url, r, failures, "downloading");
    }
    impl_->back_off(failures);
  }
  LOOM_CHECK_SYS(::fsync(fd.get()), "fsyncing ", path.string());
}

Manifest read_manifest(const std::string& location, const RemoteOptions& remote) {
  if (!is_remote(location)) return read_manifest(fs::path(location));
  const std::string url = join_url(location, format::kManifestFile);
  return format::parse_manifest_text(RemoteClient(remote).get(url), url);
}

}  // namespace loom::data
