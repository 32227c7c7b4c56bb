// Datasets read from remote storage: http:// and https:// (range requests) and s3:// (SigV4),
// with retries, resumed downloads, and a node-local cache that every rank on a node shares.
//
// A remote dataset is named by the URL of its directory: `https://host/data/kjv` reads
// `https://host/data/kjv/manifest.json` and the shards beside it; `s3://bucket/data/kjv` the
// same keys in the bucket. data::Reader opens such a name through a NodeCache: each shard is
// downloaded once per node, hash-checked against the manifest before any read, and pinned
// while a reader has it open. docs/datasets.md ("Remote datasets") has the details.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/data/dataset.h"
#include "loom/error.h"
#include "loom/visibility.h"

namespace loom::data {

// True for "http://...", "https://..." and "s3://..." locations.
LOOM_API bool is_remote(std::string_view location);

// `base` + "/" + `name` (one '/' between them).
LOOM_API std::string join_url(const std::string& base, const std::string& name);

struct RemoteOptions {
  // Tries per request: timeouts, refused or dropped connections, truncated bodies, HTTP 408,
  // 429 and 5xx are retried; 404, 401, 403 and other 4xx are not.
  int attempts = 8;
  // Delay before retry k (k = 1, 2, ...): uniform in [0, min(backoff_max_s, backoff_s * 2^k))
  // ("full jitter"), so that the ranks of a job do not retry in lockstep.
  double backoff_s = 0.2;
  double backoff_max_s = 10;
  double connect_timeout_s = 10;
  // A transfer that moves under 1 KiB/s for this long counts as timed out and is retried.
  double stall_timeout_s = 30;
  // s3://. Empty fields come from the environment: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL;
  // AWS_REGION or AWS_DEFAULT_REGION (else us-east-1); AWS_ACCESS_KEY_ID,
  // AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN. Without an endpoint, bucket "b" is
  // https://b.s3.REGION.amazonaws.com; with one, path-style ENDPOINT/b/key. Without keys the
  // requests are anonymous.
  std::string s3_endpoint;
  std::string s3_region;
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  // https: the CA bundle to trust instead of the system's (a test's own certificate); empty:
  // the system's.
  std::string ca_file;
  // Extra request headers, "Name: value" (a job token for the agents' snapshot servers).
  std::vector<std::string> headers;
};

// A remote request that failed for good: the URL, the HTTP status of the last attempt (0 when
// no response came: refused, timed out, dropped) and how many attempts were made.
class LOOM_API RemoteError : public IoError {
 public:
  RemoteError(std::string url, long status, int attempts, const std::string& what)
      : IoError(what), url_(std::move(url)), status_(status), attempts_(attempts) {}
  const std::string& url() const { return url_; }
  long status() const { return status_; }
  int attempts() const { return attempts_; }

 private:
  std::string url_;
  long status_;
  int attempts_;
};

// Counts of one RemoteClient's requests, for tests and benchmarks.
struct RemoteStats {
  uint64_t requests = 0;  // HTTP requests made, retries included
  uint64_t retries = 0;   // of those, the ones after a failed attempt
  uint64_t bytes = 0;     // body bytes received
};

// Fetches objects from http(s):// and s3:// URLs. Thread-safe: each call uses its own
// connection.
class LOOM_API RemoteClient {
 public:
  explicit RemoteClient(RemoteOptions options = {});
  ~RemoteClient();
  RemoteClient(const RemoteClient&) = delete;
  RemoteClient& operator=(const RemoteClient&) = delete;

  // The whole object; for small ones (manifests, tokenizer files). RemoteError when it fails.
  std::string get(const std::string& url) const;

  // Downloads `url` into `path` until it holds `bytes` bytes. Bytes already in `path` (a
  // download a failure or a killed process left behind) are kept and the rest is requested
  // with a Range request; an attempt that breaks off resumes the same way. RemoteError when
  // it gives up; CorruptData when the object is not `bytes` long. The caller checks the
  // content's hash.
  void download(const std::string& url, const std::filesystem::path& path, uint64_t bytes) const;

  // The http(s) URL a request for `url` goes to (s3:// mapped to its endpoint).
  std::string http_url(const std::string& url) const;
  const RemoteOptions& options() const;
  RemoteStats stats() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

// A dataset's manifest from its location: a local directory (read_manifest) or the URL of a
// remote one, fetched with `remote`'s retries and credentials and checked as a local manifest
// is. Errors as read_manifest's, and RemoteError naming the URL when it cannot be fetched.
LOOM_API Manifest read_manifest(const std::string& location, const RemoteOptions& remote);

}  // namespace loom::data
