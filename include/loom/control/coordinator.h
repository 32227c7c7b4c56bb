// The coordinator of a Loom job: a gRPC server (proto/loom.proto) that `loom run` hosts on
// node 0. It holds the rendezvous key-value store the workers' collectives bootstrap over,
// the membership of the agents (one per node) and the generation they run, and the workers'
// heartbeats and status. It decides when a generation ends (a worker failed, a worker or a
// node went silent) and when the job is over; the agents act on that (docs/launcher.md).
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

#include "loom/control/tls.h"
#include "loom/visibility.h"

namespace loom::control {

// The job's timing defaults, stated once: the coordinator, its membership state machine,
// `loom run`'s agents and its flags all start from these.
inline constexpr std::chrono::milliseconds kDefaultLastCall{std::chrono::seconds(2)};
inline constexpr std::chrono::milliseconds kDefaultNodeTimeout{std::chrono::seconds(5)};
inline constexpr std::chrono::milliseconds kDefaultWorkerTimeout{std::chrono::seconds(60)};

struct CoordinatorOptions {
  // host:port to listen on; port 0 picks a free port (address() says which).
  std::string address = "127.0.0.1:0";
  // Listening on anything but loopback exposes the job's store to the network: it needs this
  // flag and a non-empty token.
  bool allow_non_loopback = false;
  // When non-empty, every call must carry it in the "loom-token" metadata entry.
  std::string token;
  // TLS: with cert and key, it serves TLS only (plaintext clients are refused); with ca too,
  // clients must present a certificate signed by it (mutual TLS). See TlsFiles.
  TlsFiles tls;
  int min_nodes = 1;  // a rendezvous round closes once this many agents joined and ...
  int max_nodes = 1;  // ... this many joined, or last_call passed since min_nodes was reached
  std::chrono::milliseconds last_call = kDefaultLastCall;
  // Generations ended by a failure (a worker exited with an error, died or went silent)
  // beyond this many fail the job. A node lost or added does not count.
  int max_restarts = 0;
  // An agent silent this long is lost: its generation ends and the others re-rendezvous.
  std::chrono::milliseconds node_timeout = kDefaultNodeTimeout;
  // A worker that has sent a heartbeat in this generation and then stays silent this long is
  // dead or hung: its generation ends (as a failure).
  std::chrono::milliseconds worker_timeout = kDefaultWorkerTimeout;
  // Job-wide metrics over HTTP (docs/observability.md): host:port for `/metrics` (the
  // Prometheus text format), `/api/metrics` (JSON, for `loom top`) and `/`, the dashboard;
  // port 0 picks one; empty = no HTTP endpoint. Beyond loopback it needs allow_non_loopback
  // and the token, which every request then carries as "Authorization: Bearer <token>".
  std::string metrics_address;
  // The run directory whose traces/ and flight/ the dashboard links; empty: none.
  std::filesystem::path run_dir;
  // Points kept per rank: each worker heartbeat (about 1 Hz) with finished steps adds one.
  size_t metrics_history = 3600;
  // A rank is flagged as a straggler (logged, and in /metrics) while the median of its
  // newest straggler_window reports' step time outside collective waits exceeds
  // straggler_threshold times the other ranks' median.
  double straggler_threshold = 1.3;
  size_t straggler_window = 10;
  // The hang watchdog: when no rank has finished a step for hang_factor times the median step
  // time, and at least hang_min_seconds, the job is hung: the coordinator logs each rank's
  // step, phase and collective in flight, and has every rank dump its flight recorder.
  // hang_factor 0 turns it off. It needs workers that report steps (metrics::MetricsLogger).
  double hang_factor = 10;
  double hang_min_seconds = 60;
  // Where it logs generations, failures and refused calls; null = spdlog's default logger.
  std::shared_ptr<spdlog::logger> log;
};

// The running server. Thread-safe; the destructor shuts it down (blocked calls return).
class LOOM_API Coordinator {
 public:
  // Starts listening. Bad options are InvalidArgument; an address it cannot bind, or a TLS
  // file it cannot read, is IoError.
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // The address it listens on, with the port chosen ("127.0.0.1:40123").
  const std::string& address() const;
  // The metrics endpoint's address with its port ("127.0.0.1:40124"); empty when none.
  const std::string& metrics_address() const;
  // The job's metrics as /api/metrics serves them (docs/observability.md), whether or not the
  // endpoint is served: `loom run` saves them to <run_dir>/job_metrics.json.
  std::string job_metrics_json() const;
  // True once the job finished or failed for good.
  bool done() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

// A fresh random job token (32 hex digits) from the system's entropy source.
LOOM_API std::string generate_token();

}  // namespace loom::control
