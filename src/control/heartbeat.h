// A worker's heartbeat to the coordinator, from a background thread, while the worker runs
// under `loom run`. It carries the training progress the worker last reported, and turns a
// flight-dump request into a call of the given callback. Private to Loom (Runtime owns one).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <spdlog/spdlog.h>

#include "loom/control/tls.h"

namespace loom::control {

// What a worker is doing at the moment of a beat: its training loop's phase
// (metrics::current_activity) and the oldest collective in flight ("" when none).
struct Activity {
  std::string phase;
  std::string collective;
};

struct HeartbeatOptions {
  std::string address;  // the coordinator
  std::string token;
  TlsFiles tls;  // as the coordinator needs (LOOM_TLS_* under `loom run`)
  int rank = 0;
  int64_t generation = 0;
  std::chrono::milliseconds interval{std::chrono::seconds(1)};
  std::function<void()> on_flight_dump;  // called on the heartbeat thread
  std::function<Activity()> activity;    // read before every beat, on the heartbeat thread
  std::shared_ptr<spdlog::logger> log;
};

// One finished step as the heartbeat reports it to the coordinator's job-wide metrics.
struct StepSample {
  int64_t step = 0;  // 0-based index
  double seconds = 0;
  std::map<std::string, double> phase_seconds;  // metrics::Phase names
  int64_t tokens = 0;                           // trained on in the step, this rank
  int64_t samples = 0;
  double mfu = -1;  // the step's; < 0: unknown
  int64_t rss_bytes = 0;
  double loss = 0;
  double goodput = 0;
};

// Starts beating at construction; the destructor stops and joins the thread. update() is
// thread-safe. A coordinator that cannot be reached is logged (once per outage), not thrown:
// the launcher decides what a lost coordinator means.
class Heartbeat {
 public:
  explicit Heartbeat(HeartbeatOptions options);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  void update(int64_t step, double throughput, const std::string& state);
  // Adds a finished step to the next beat's report, which carries the means of the steps
  // since the previous beat (rates and MFU over their time; memory, loss and goodput the
  // newest). Thread-safe.
  void add_step(const StepSample& sample);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::control
