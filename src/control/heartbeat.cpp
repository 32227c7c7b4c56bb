#include "control/heartbeat.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <csignal>
#include <mutex>
#include <thread>

#include "control/client.h"

namespace loom::control {

struct Heartbeat::Impl {
  // Constant after construction.
  HeartbeatOptions options;
  CoordinatorClient client;
  pid_t parent = ::getppid();  // the agent that started this worker

  // State below is protected by mutex.
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  int64_t step = 0;
  double throughput = 0;
  std::string state = "starting";
  // The steps since the last beat: times, counts and mfu * seconds summed (-1 once a step's
  // MFU is unknown); the rest the newest.
  int64_t steps = 0;
  StepSample sums{.mfu = 0};

  std::thread thread;

  explicit Impl(HeartbeatOptions o)
      : options(std::move(o)),
        client(options.address, options.token, std::chrono::seconds(5), options.tls) {
    thread = std::thread([this] { loop(); });
  }

  // The report of the steps since the last beat, which starts a new one. mutex held.
  void fill_report(v1::StepReport* report) {
    const double n = static_cast<double>(steps);
    report->set_steps(steps);
    report->set_last_step(sums.step);
    report->set_step_seconds(sums.seconds / n);
    for (const auto& [phase, seconds] : sums.phase_seconds)
      (*report->mutable_phase_seconds())[phase] = seconds / n;
    const double seconds = std::max(sums.seconds, 1e-12);
    report->set_tokens_per_second(static_cast<double>(sums.tokens) / seconds);
    report->set_samples_per_second(static_cast<double>(sums.samples) / seconds);
    report->set_mfu(sums.mfu < 0 ? -1 : sums.mfu / seconds);
    report->set_rss_bytes(sums.rss_bytes);
    report->set_loss(sums.loss);
    report->set_goodput(sums.goodput);
    steps = 0;
    sums = StepSample{.mfu = 0};
  }

  void loop() {
    int64_t dumps_seen = -1;
    bool reachable = true;
    bool terminated = false;
    std::unique_lock<std::mutex> lock(mutex);
    while (!stop) {
      v1::HeartbeatRequest beat;
      beat.set_rank(options.rank);
      beat.set_generation(options.generation);
      beat.set_step(step);
      beat.set_throughput(throughput);
      beat.set_state(state);
      if (steps > 0) fill_report(beat.mutable_report());
      lock.unlock();
      if (options.activity) {
        Activity now = options.activity();
        beat.set_phase(std::move(now.phase));
        beat.set_collective(std::move(now.collective));
      }
      try {
        const auto reply = client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat);
        if (!reachable && options.log)
          options.log->info("heartbeat: the coordinator answers again");
        reachable = true;
        if (dumps_seen >= 0 && reply.flight_dump_epoch() > dumps_seen && options.on_flight_dump) {
          options.on_flight_dump();
        }
        dumps_seen = reply.flight_dump_epoch();
        // Orphaned (the agent died) in a generation that is over: nobody will stop this worker,
        // and its peers are gone. SIGTERM lets a trainer that handles it exit cleanly.
        if (reply.state() != v1::RUNNING && ::getppid() != parent && !terminated) {
          if (options.log)
            options.log->error(
                "heartbeat: generation {} is over and this worker's launcher is gone: stopping",
                options.generation);
          terminated = true;
          std::raise(SIGTERM);
        }
      } catch (const std::exception& e) {
        if (reachable && options.log) options.log->warn("heartbeat: {}", e.what());
        reachable = false;
      }
      lock.lock();
      wake.wait_for(lock, options.interval, [&] { return stop; });
    }
  }
};

Heartbeat::Heartbeat(HeartbeatOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  impl_->thread.join();
}

void Heartbeat::update(int64_t step, double throughput, const std::string& state) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->step = step;
  impl_->throughput = throughput;
  impl_->state = state;
}

void Heartbeat::add_step(const StepSample& sample) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Impl& s = *impl_;
  ++s.steps;
  s.sums.step = sample.step;
  s.sums.seconds += sample.seconds;
  for (const auto& [phase, seconds] : sample.phase_seconds) s.sums.phase_seconds[phase] += seconds;
  s.sums.tokens += sample.tokens;
  s.sums.samples += sample.samples;
  // MFU over the window: the steps' MFU weighted by their time (tokens over time, scaled).
  s.sums.mfu = sample.mfu < 0 || s.sums.mfu < 0 ? -1 : s.sums.mfu + sample.mfu * sample.seconds;
  s.sums.rss_bytes = sample.rss_bytes;
  s.sums.loss = sample.loss;
  s.sums.goodput = sample.goodput;
}

}  // namespace loom::control
