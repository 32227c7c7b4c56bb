// bench_coordinator: the coordinator of `loom run` under the load of a large job, on loopback.
//
// A coordinator runs in a child process (this binary with --serve) pinned to one core; this
// process joins it as one node of --workers ranks and then plays those ranks for --seconds:
//   heartbeat  every worker's heartbeat, once a second (what control::Heartbeat sends), plus
//              the agent's own once a second;
//   store      every --store-every seconds each worker sets its key, reads it back and adds
//              to a shared counter (the rendezvous traffic of a restart, spread out).
// Each worker has its own connection (as each worker process has), and the calls of all of
// them are spread evenly over each second. Calls are asynchronous, so a slow answer delays no
// other call: the latency of a call is from its scheduled time to its answer.
//
// Reported, against the goals of issue 21 (1,000 workers on one core, p99 under 50 ms):
//   heartbeat_p99, store_p99   the 99th percentile latency beside 50 ms (ratio 50 / p99), with
//                              the median, the maximum, the call count and the failures;
//   coordinator_cpu            the coordinator's CPU time over the measured seconds (cores)
//                              beside the one core it has (ratio 1 / cores), with its resident
//                              memory idle (mostly libtorch's code), at the end, and at peak.
// Every heartbeat must be answered "running", and at the end the coordinator's status must
// list every worker at its last step: a failed call fails the run (exit status 1).
// The first --warmup seconds (connections opening) are not counted; --rounds repeats the whole
// run (a fresh coordinator each time) and reports the median and range over rounds.
//
//   bench_coordinator                           1,000 workers, 60 s
//   bench_coordinator --workers=100 --seconds=3 --warmup=1 --json
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_report.h"
#include "loom.grpc.pb.h"
#include "loom/control/coordinator.h"
#include "loom/error.h"

extern char** environ;

namespace {

namespace v1 = loom::control::v1;
using Clock = std::chrono::steady_clock;

constexpr double kGoalP99Ms = 50;
constexpr const char* kTokenMetadata = "loom-token";

struct Settings {
  int workers = 1000;
  double seconds = 60;
  double warmup = 5;
  double store_every = 5;
  int rounds = 1;
  bool json = false;
  // --serve: the child's side.
  bool serve = false;
  std::string token;
};

// Lets this process have one descriptor per connection (1,000 and more).
void raise_descriptor_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

void pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

// --serve: a coordinator for one node, the address on stdout, until stdin closes.
int serve(const Settings& s) {
  raise_descriptor_limit();
  pin_to_cpu(0);
  auto log = std::make_shared<spdlog::logger>("coordinator");  // no sinks: quiet
  loom::control::Coordinator coordinator({.token = s.token,
                                          .min_nodes = 1,
                                          .max_nodes = 1,
                                          .last_call = std::chrono::milliseconds(0),
                                          .node_timeout = std::chrono::seconds(30),
                                          .worker_timeout = std::chrono::seconds(30),
                                          .log = log});
  std::printf("%s\n", coordinator.address().c_str());
  std::fflush(stdout);
  char byte;
  while (read(0, &byte, 1) > 0) {
  }
  return 0;
}

// The coordinator's child process: its pid, its address, and the pipe whose closing stops it.
struct Server {
  pid_t pid = -1;
  std::string address;
  int stop_fd = -1;

  explicit Server(const std::string& token) {
    int to_child[2], from_child[2];
    LOOM_CHECK(pipe(to_child) == 0 && pipe(from_child) == 0, loom::IoError,
               "pipe: ", std::strerror(errno));
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    std::string token_arg = "--token=" + token;
    char* argv[] = {self.data(), const_cast<char*>("--serve"), token_arg.data(), nullptr};
    const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    LOOM_CHECK(rc == 0, loom::IoError, "cannot start ", self, " --serve: ", std::strerror(rc));
    close(to_child[0]);
    close(from_child[1]);
    stop_fd = to_child[1];
    char c;
    while (read(from_child[0], &c, 1) == 1 && c != '\n') address += c;
    close(from_child[0]);
    LOOM_CHECK(!address.empty(), loom::IoError, "the coordinator process printed no address");
  }
  ~Server() {
    close(stop_fd);
    int status = 0;
    waitpid(pid, &status, 0);
  }

  // utime + stime in seconds (/proc/<pid>/stat fields 14 and 15).
  double cpu_seconds() const {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::istringstream fields(text.substr(text.rfind(')') + 2));
    std::string field;
    double ticks = 0;
    for (int i = 3; i <= 15 && fields >> field; ++i) {
      if (i >= 14) ticks += std::stod(field);
    }
    return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  // A field of /proc/<pid>/status in MiB (VmRSS, VmHWM).
  double memory_mib(const std::string& key) const {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / 1024;
    }
    return 0;
  }
};

// This process's CPU time (the load driver's), in seconds.
double own_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

enum Kind { kHeartbeat, kStore };

// One call in flight; its completion-queue tag.
struct Call {
  virtual ~Call() = default;
  grpc::ClientContext context;
  grpc::Status status;
  Kind kind = kHeartbeat;
  Clock::time_point scheduled;
  bool counted = false;  // issued after the warmup
};
template <typename Reply>
struct TypedCall : Call {
  Reply reply;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Reply>> reader;
};

struct Samples {
  std::vector<double> latency_ms[2];
  int64_t failures[2] = {0, 0};
  std::string first_failure;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(p * v.size())) - 1);
  return v[i];
}

struct RoundResult {
  double p50[2], p99[2], max[2], rps[2];
  int64_t calls[2], failures[2];
  double cpu_cores = 0, driver_cores = 0, idle_mib = 0, rss_mib = 0, peak_mib = 0;
};

RoundResult run_round(const Settings& s) {
  const std::string token = "bench-coordinator-token";
  Server server(token);
  const double idle_mib = server.memory_mib("VmRSS");

  // One connection per worker (plus the agent's): a local subchannel pool per channel, or
  // gRPC would share one connection between channels of the same target.
  auto channel_for = [&] {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(server.address, grpc::InsecureChannelCredentials(), args);
  };
  auto agent = v1::Coordinator::NewStub(channel_for());
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;
  for (int w = 0; w < s.workers; ++w) stubs.push_back(v1::Coordinator::NewStub(channel_for()));

  const std::string node_id = "bench-node";
  v1::JoinRequest join;
  join.set_node_id(node_id);
  join.set_nproc(s.workers);
  join.set_node_rank_hint(-1);
  join.set_timeout_ms(30000);
  v1::JoinReply joined;
  {
    grpc::ClientContext context;
    context.AddMetadata(kTokenMetadata, token);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    context.set_wait_for_ready(true);
    const grpc::Status status = agent->Join(&context, join, &joined);
    LOOM_CHECK(status.ok() && joined.outcome() == v1::JOIN_ADMITTED, loom::CommError,
               "Join failed: ", status.error_message(), " ", joined.reason());
  }
  const int64_t generation = joined.generation();

  grpc::CompletionQueue cq;
  Samples samples;
  std::atomic<int64_t> in_flight{0};
  std::thread completer([&] {
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
      std::unique_ptr<Call> call(static_cast<Call*>(tag));
      const double ms =
          std::chrono::duration<double, std::milli>(Clock::now() - call->scheduled).count();
      // A heartbeat must find its generation running: anything else is a failure too.
      auto* beat = dynamic_cast<TypedCall<v1::HeartbeatReply>*>(call.get());
      if (ok && call->status.ok() && beat != nullptr && beat->reply.state() != v1::RUNNING) {
        call->status =
            grpc::Status(grpc::StatusCode::INTERNAL, "heartbeat answered state " +
                                                         std::to_string(beat->reply.state()) +
                                                         ": " + beat->reply.reason());
      }
      if (call->counted) {
        if (!ok || !call->status.ok()) {
          if (samples.failures[call->kind]++ == 0) {
            samples.first_failure = call->status.error_message();
          }
        } else {
          samples.latency_ms[call->kind].push_back(ms);
        }
      }
      --in_flight;
    }
  });

  const Clock::time_point start = Clock::now();
  const Clock::time_point measure_from =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s.warmup));
  const Clock::time_point end = measure_from + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(s.seconds));

  auto prepare = [&](Call& call, Kind kind, Clock::time_point when) {
    call.context.AddMetadata(kTokenMetadata, token);
    call.context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    call.kind = kind;
    call.scheduled = when;
    call.counted = when >= measure_from;
    ++in_flight;
  };
  auto heartbeat = [&](v1::Coordinator::Stub& stub, int rank, Clock::time_point when,
                       int64_t step) {
    auto* call = new TypedCall<v1::HeartbeatReply>;
    prepare(*call, kHeartbeat, when);
    v1::HeartbeatRequest request;
    request.set_rank(rank);
    request.set_generation(generation);
    if (rank < 0) {
      request.set_node_id(node_id);
    } else {
      request.set_step(step);
      request.set_throughput(12345.0);
      request.set_state("training");
    }
    call->reader = stub.AsyncHeartbeat(&call->context, request, &cq);
    call->reader->Finish(&call->reply, &call->status, call);
  };
  const std::string value(64, 'v');
  auto store_ops = [&](v1::Coordinator::Stub& stub, int rank, Clock::time_point when) {
    const std::string key = "bench/worker/" + std::to_string(rank);
    {
      auto* call = new TypedCall<v1::SetReply>;
      prepare(*call, kStore, when);
      v1::SetRequest request;
      request.set_key(key);
      request.set_value(value);
      call->reader = stub.AsyncSet(&call->context, request, &cq);
      call->reader->Finish(&call->reply, &call->status, call);
    }
    {
      // Issued right after the Set: the server may take it first, so it waits for the key
      // (up to 1 s, as a worker's Get during rendezvous does); the key exists from the
      // worker's first round on.
      auto* call = new TypedCall<v1::GetReply>;
      prepare(*call, kStore, when);
      v1::GetRequest request;
      request.set_key(key);
      request.set_timeout_ms(1000);
      call->reader = stub.AsyncGet(&call->context, request, &cq);
      call->reader->Finish(&call->reply, &call->status, call);
    }
    {
      auto* call = new TypedCall<v1::AddReply>;
      prepare(*call, kStore, when);
      v1::AddRequest request;
      request.set_key("bench/counter");
      request.set_delta(1);
      call->reader = stub.AsyncAdd(&call->context, request, &cq);
      call->reader->Finish(&call->reply, &call->status, call);
    }
  };

  // The schedule: worker w beats at w / workers of every second; its store operations come
  // every store_every seconds, offset by w / workers of that period.
  double cpu_at_start = -1, driver_at_start = 0;
  const double store_period = s.store_every;
  int64_t store_slot = 0;  // the n-th store turn: worker n % workers, at n * period / workers
  for (int64_t second = 0;; ++second) {
    const Clock::time_point second_start = start + std::chrono::seconds(second);
    if (second_start >= end) break;
    heartbeat(*agent, -1, second_start, 0);
    for (int w = 0; w < s.workers; ++w) {
      const Clock::time_point when =
          second_start + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(static_cast<double>(w) / s.workers));
      // Store operations due before this beat.
      for (;;) {
        const double at = static_cast<double>(store_slot) * store_period / s.workers;
        const Clock::time_point store_when =
            start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at));
        if (store_when > when) break;
        std::this_thread::sleep_until(store_when);
        store_ops(*stubs[store_slot % s.workers], static_cast<int>(store_slot % s.workers),
                  store_when);
        ++store_slot;
      }
      std::this_thread::sleep_until(when);
      if (cpu_at_start < 0 && when >= measure_from) {
        cpu_at_start = server.cpu_seconds();
        driver_at_start = own_cpu_seconds();
      }
      heartbeat(*stubs[w], w, when, second);
    }
  }
  std::this_thread::sleep_until(end);
  const double cpu_used = server.cpu_seconds() - std::max(cpu_at_start, 0.0);
  const double driver_used = own_cpu_seconds() - driver_at_start;
  // Everything answered (or failed at its deadline) before the server goes.
  while (in_flight.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // The coordinator saw every worker, and each one's last step.
  {
    grpc::ClientContext context;
    context.AddMetadata(kTokenMetadata, token);
    v1::JobStatus status;
    const grpc::Status rpc = agent->GetStatus(&context, v1::StatusRequest(), &status);
    LOOM_CHECK(rpc.ok(), loom::CommError, "GetStatus failed: ", rpc.error_message());
    int64_t current = 0;
    const int64_t last_second = static_cast<int64_t>(std::ceil(s.warmup + s.seconds)) - 1;
    for (const auto& worker : status.workers()) current += worker.step() >= last_second - 1;
    LOOM_CHECK(status.workers_size() == s.workers && current == s.workers, loom::Error,
               "the coordinator lists ", status.workers_size(), " workers, ", current,
               " of them at step ", last_second - 1, " or later; expected ", s.workers);
  }
  RoundResult r;
  r.idle_mib = idle_mib;
  r.rss_mib = server.memory_mib("VmRSS");
  r.peak_mib = server.memory_mib("VmHWM");
  cq.Shutdown();
  completer.join();
  r.cpu_cores = cpu_used / s.seconds;
  r.driver_cores = driver_used / s.seconds;
  for (int k = 0; k < 2; ++k) {
    const auto& v = samples.latency_ms[k];
    r.p50[k] = percentile(v, 0.50);
    r.p99[k] = percentile(v, 0.99);
    r.max[k] = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
    r.calls[k] = static_cast<int64_t>(v.size());
    r.failures[k] = samples.failures[k];
    r.rps[k] = static_cast<double>(v.size()) / s.seconds;
  }
  if (!samples.first_failure.empty()) {
    std::fprintf(stderr, "bench_coordinator: %lld failed calls; the first: %s\n",
                 static_cast<long long>(r.failures[0] + r.failures[1]),
                 samples.first_failure.c_str());
  }
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "bench_coordinator: the coordinator of `loom run` under a large job's heartbeats and "
      "store traffic, on loopback, beside the goals (p99 under 50 ms on one core)"};
  app.add_option("--workers", s.workers, "simulated workers, each with its own connection")
      ->check(CLI::Range(1, 100000));
  app.add_option("--seconds", s.seconds, "measured seconds per round")->check(CLI::PositiveNumber);
  app.add_option("--warmup", s.warmup, "seconds before the measurement (connections opening)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--store-every", s.store_every,
                 "seconds between one worker's store operations (Set, Get, Add)")
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", s.rounds, "rounds, each with a fresh coordinator; medians reported")
      ->check(CLI::Range(1, 100));
  app.add_flag("--json", s.json, "print one JSON object per row");
  app.add_flag("--serve", s.serve, "internal: run the coordinator and print its address");
  app.add_option("--token", s.token, "internal: the job token --serve requires");
  CLI11_PARSE(app, argc, argv);
  if (s.serve) return serve(s);

  raise_descriptor_limit();
  if (std::thread::hardware_concurrency() > 1) pin_to_cpu(1);  // off the coordinator's core
  std::vector<RoundResult> rounds;
  for (int i = 0; i < s.rounds; ++i) {
    if (!s.json) {
      std::fprintf(stderr, "round %d of %d: %d workers for %.0f s (+%.0f s warmup)...\n", i + 1,
                   s.rounds, s.workers, s.seconds, s.warmup);
    }
    rounds.push_back(run_round(s));
  }

  auto over_rounds = [&](auto field) {
    std::vector<double> v;
    for (const RoundResult& r : rounds) v.push_back(field(r));
    return std::make_tuple(median(v), *std::min_element(v.begin(), v.end()),
                           *std::max_element(v.begin(), v.end()));
  };
  const std::string suffix = "/" + std::to_string(s.workers) + "workers";
  std::vector<loom::bench::Row> rows;
  const char* names[2] = {"heartbeat_p99", "store_p99"};
  for (int k = 0; k < 2; ++k) {
    auto [p99, p99_min, p99_max] = over_rounds([k](const RoundResult& r) { return r.p99[k]; });
    loom::bench::Row row{.bench = "coordinator",
                         .case_name = names[k] + suffix,
                         .loom = p99,
                         .baseline = kGoalP99Ms,
                         .baseline_name = "goal_p99_ms",
                         .unit = "ms",
                         .ratio = p99 > 0 ? kGoalP99Ms / p99 : 0};
    row.extra["p99_min_ms"] = p99_min;
    row.extra["p99_max_ms"] = p99_max;
    row.extra["p50_ms"] = std::get<0>(over_rounds([k](const RoundResult& r) { return r.p50[k]; }));
    row.extra["max_ms"] = std::get<0>(over_rounds([k](const RoundResult& r) { return r.max[k]; }));
    row.extra["calls_per_s"] =
        std::get<0>(over_rounds([k](const RoundResult& r) { return r.rps[k]; }));
    double failures = 0;
    for (const RoundResult& r : rounds) failures += static_cast<double>(r.failures[k]);
    row.extra["failures"] = failures;
    rows.push_back(row);
  }
  {
    auto [cores, cores_min, cores_max] =
        over_rounds([](const RoundResult& r) { return r.cpu_cores; });
    loom::bench::Row row{.bench = "coordinator",
                         .case_name = "coordinator_cpu" + suffix,
                         .loom = cores,
                         .baseline = 1.0,
                         .baseline_name = "one_core",
                         .unit = "cores",
                         .ratio = cores > 0 ? 1.0 / cores : 0};
    row.extra["cores_min"] = cores_min;
    row.extra["cores_max"] = cores_max;
    row.extra["rss_mib"] = std::get<0>(over_rounds([](const RoundResult& r) { return r.rss_mib; }));
    row.extra["peak_rss_mib"] =
        std::get<0>(over_rounds([](const RoundResult& r) { return r.peak_mib; }));
    // The driver's own CPU: near 1 core, it (not the coordinator) limits the rate and the
    // latencies measured.
    row.extra["driver_cores"] =
        std::get<0>(over_rounds([](const RoundResult& r) { return r.driver_cores; }));
    row.extra["idle_rss_mib"] =
        std::get<0>(over_rounds([](const RoundResult& r) { return r.idle_mib; }));
    rows.push_back(row);
  }

  if (s.json) {
    for (const auto& row : rows) loom::bench::print_json(row);
  } else {
    std::printf("%-28s %9s %9s %9s %9s %7s  %s\n", "case (latency)", "p99 ms", "goal ms", "p50 ms",
                "max ms", "ratio", "p99 over rounds");
    for (int k = 0; k < 2; ++k) {
      const auto& row = rows[k];
      std::printf("%-28s %9.2f %9.0f %9.2f %9.2f %7.2f  %.2f..%.2f ms, %.0f calls/s, %.0f failed\n",
                  row.case_name.c_str(), row.loom, row.baseline, row.extra.at("p50_ms"),
                  row.extra.at("max_ms"), row.ratio, row.extra.at("p99_min_ms"),
                  row.extra.at("p99_max_ms"), row.extra.at("calls_per_s"),
                  row.extra.at("failures"));
    }
    const auto& cpu = rows[2];
    std::printf(
        "%-28s %9.3f %9.0f %9s %9s %7.2f  %.3f..%.3f cores; RSS %.1f MiB idle, %.1f at the "
        "end, peak %.1f; the load driver used %.2f cores\n",
        cpu.case_name.c_str(), cpu.loom, cpu.baseline, "(cores)", "", cpu.ratio,
        cpu.extra.at("cores_min"), cpu.extra.at("cores_max"), cpu.extra.at("idle_rss_mib"),
        cpu.extra.at("rss_mib"), cpu.extra.at("peak_rss_mib"), cpu.extra.at("driver_cores"));
  }
  // Failed calls make the run a failure: the figures would leave them out.
  return rows[0].extra.at("failures") + rows[1].extra.at("failures") > 0 ? 1 : 0;
}
