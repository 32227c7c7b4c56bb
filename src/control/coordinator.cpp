// The coordinator's gRPC service: the key-value store (an InMemoryStore behind RPCs), and a
// thin adapter from the membership RPCs (Join, Heartbeat, ReportFailure, Leave, GetStatus) to
// the Membership state machine (membership.h), plus the monitor thread that ticks its clock.
#include "loom/control/coordinator.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "control/auth.h"
#include "control/dashboard.h"
#include "control/membership.h"
#include "control/service_keys.h"
#include "control/step_report.h"
#include "control/tls.h"
#include "loom.grpc.pb.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/deadline.h"

namespace loom::control {
namespace {

namespace v1 = loom::control::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Blocking store calls wait in slices so that a cancelled call or a shutdown frees its thread.
constexpr milliseconds kSlice{200};

// A client's timeout_ms as a wait: negative is 0, and at most a day, so that adding it to
// Clock::now() cannot overflow (INT64_MAX ms is past the clock's range).
milliseconds rpc_wait(int64_t timeout_ms) {
  return milliseconds(std::clamp<int64_t>(timeout_ms, 0, int64_t{24} * 3600 * 1000));
}

bool is_loopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "[::1]" || host == "::1";
}

v1::GenerationState to_proto(HeartbeatResult::State state) {
  switch (state) {
    case HeartbeatResult::kRunning:
      return v1::RUNNING;
    case HeartbeatResult::kEnded:
      return v1::ENDED;
    case HeartbeatResult::kFinished:
      return v1::FINISHED;
    case HeartbeatResult::kFailed:
      return v1::FAILED;
  }
  return v1::GENERATION_UNKNOWN;
}

v1::GenerationState to_proto(Phase phase) {
  switch (phase) {
    case Phase::kGathering:
      return v1::ENDED;
    case Phase::kRunning:
      return v1::RUNNING;
    case Phase::kFinished:
      return v1::FINISHED;
    case Phase::kFailed:
      return v1::FAILED;
  }
  return v1::GENERATION_UNKNOWN;
}

v1::JoinOutcome to_proto(JoinResult::Outcome outcome) {
  switch (outcome) {
    case JoinResult::kAdmitted:
      return v1::JOIN_ADMITTED;
    case JoinResult::kWaiting:
      return v1::JOIN_WAITING;
    case JoinResult::kJobFinished:
      return v1::JOIN_JOB_FINISHED;
    case JoinResult::kJobFailed:
      return v1::JOIN_JOB_FAILED;
  }
  return v1::JOIN_OUTCOME_UNKNOWN;
}

grpc::Status invalid_argument(const InvalidArgument& e) {
  return {grpc::StatusCode::INVALID_ARGUMENT, e.what()};
}

}  // namespace

std::string generate_token() {
  std::ifstream random("/dev/urandom", std::ios::binary);
  unsigned char bytes[16];
  random.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  LOOM_CHECK(random.good(), IoError, "cannot read /dev/urandom for a job token");
  std::string hex;
  for (unsigned char b : bytes) {
    const char* digits = "0123456789abcdef";
    hex += digits[b >> 4];
    hex += digits[b & 15];
  }
  return hex;
}

struct Coordinator::Impl final : v1::Coordinator::Service {
  // Constant after construction.
  CoordinatorOptions options;
  std::string address;

  mutable comm::InMemoryStore store;  // thread-safe on its own (mutable: its reads are const)

  // State below is protected by mutex; changed is notified whenever membership's phase
  // changed (a round closed, a generation ended, the job is over), so that blocked Join calls
  // look again. Not on every call: blocked Joins renew theirs, and would wake each other.
  mutable std::mutex mutex;
  std::condition_variable changed;
  bool shutting_down = false;
  Membership membership;
  JobMetrics job_metrics;
  int64_t flight_dump_epoch = 0;

  std::unique_ptr<grpc::Server> server;
  std::thread monitor;
  // The metrics endpoint, when options.metrics_address is set.
  std::unique_ptr<httplib::Server> http;
  std::string http_address;
  std::thread http_thread;

  explicit Impl(CoordinatorOptions opts)
      : options(std::move(opts)),
        membership({.min_nodes = options.min_nodes,
                    .max_nodes = options.max_nodes,
                    .last_call = options.last_call,
                    .max_restarts = options.max_restarts,
                    .node_timeout = options.node_timeout,
                    .worker_timeout = options.worker_timeout}),
        job_metrics({.history = options.metrics_history,
                     .straggler_threshold = options.straggler_threshold,
                     .straggler_window = options.straggler_window,
                     .hang_factor = options.hang_factor,
                     .hang_min_seconds = options.hang_min_seconds}) {
    if (!is_loopback(options.address)) {
      LOOM_CHECK(options.allow_non_loopback, InvalidArgument, "the coordinator would listen on ",
                 options.address,
                 ", beyond loopback: anyone who can reach it could join the job. Pass "
                 "--coordinator-public to allow it (a job token is then required)");
      LOOM_CHECK(!options.token.empty(), InvalidArgument,
                 "a coordinator listening beyond loopback needs a job token");
    }
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(options.address, server_credentials(options.tls), &port);
    builder.RegisterService(this);
    grpc::ResourceQuota quota("loom-coordinator");
    quota.SetMaxThreads(512);
    builder.SetResourceQuota(quota);
    server = builder.BuildAndStart();
    LOOM_CHECK(server != nullptr && port != 0, IoError, "the coordinator cannot listen on ",
               options.address,
               options.tls.enabled() ? " (address in use or not local, or the TLS key does not "
                                       "match the certificate?)"
                                     : " (address in use or not local?)");
    address = options.address.substr(0, options.address.rfind(':') + 1) + std::to_string(port);
    if (!options.metrics_address.empty()) start_http();
    monitor = std::thread([this] { monitor_loop(); });
  }

  // The job's metrics as /api/metrics serves them.
  // With "services": every node's services as their supervisors last published them
  // (service_keys.h), node by node.
  std::string metrics_json() const {
    std::string metrics;
    {
      std::lock_guard<std::mutex> lock(mutex);
      metrics = job_metrics.json(membership.status());
    }
    nlohmann::json services = nlohmann::json::array();
    for (int node = 0; store.check({service_status_key(node)}); ++node) {
      const nlohmann::json entries = nlohmann::json::parse(
          store.get(service_status_key(node), std::chrono::milliseconds(0)), nullptr, false);
      if (!entries.is_array()) continue;  // not what a supervisor publishes: left out
      for (const nlohmann::json& e : entries) services.push_back(e);
    }
    nlohmann::json j = nlohmann::json::parse(metrics);
    j["services"] = std::move(services);
    return j.dump();
  }

  // The metrics endpoint: GET /metrics (Prometheus), and the dashboard's routes: / (the page),
  // /api/metrics (JSON), /api/files and /files/... (control/dashboard.h).
  void start_http() {
    const std::string& where = options.metrics_address;
    const size_t colon = where.rfind(':');
    LOOM_CHECK(colon != std::string::npos, InvalidArgument,
               "the metrics address must be "
               "host:port (port 0: any free port), got '",
               where, "'");
    const bool public_endpoint = !is_loopback(where);
    if (public_endpoint) {
      LOOM_CHECK(options.allow_non_loopback && !options.token.empty(), InvalidArgument,
                 "the metrics endpoint would listen on ", where,
                 ", beyond loopback: that needs --coordinator-public and a job token, which "
                 "Prometheus then sends as 'Authorization: Bearer <token>'");
    }
    http = std::make_unique<httplib::Server>();
    if (public_endpoint) {
      http->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
        if (req.get_header_value("Authorization") == "Bearer " + options.token)
          return httplib::Server::HandlerResponse::Unhandled;
        res.status = 401;
        res.set_content("wrong or missing job token (Authorization: Bearer <token>)\n",
                        "text/plain");
        return httplib::Server::HandlerResponse::Handled;
      });
    }
    http->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      std::lock_guard<std::mutex> lock(mutex);
      res.set_content(job_metrics.prometheus(membership.status()),
                      "text/plain; version=0.0.4; charset=utf-8");
    });
    add_dashboard_routes(
        *http, {.metrics_json = [this] { return metrics_json(); }, .run_dir = options.run_dir});
    std::string host = where.substr(0, colon);
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    int port = 0;
    try {
      port = std::stoi(where.substr(colon + 1));
    } catch (const std::exception&) {
      port = -1;
    }
    LOOM_CHECK(port >= 0 && port <= 65535, InvalidArgument,
               "the metrics address must be "
               "host:port with a port in [0, 65535], got '",
               where, "'");
    const int bound =
        port == 0 ? http->bind_to_any_port(host) : (http->bind_to_port(host, port) ? port : -1);
    LOOM_CHECK(bound > 0, IoError, "the metrics endpoint cannot listen on ", where,
               " (address in use or not local?)");
    http_address = where.substr(0, colon + 1) + std::to_string(bound);
    http_thread = std::thread([this] { http->listen_after_bind(); });
  }

  ~Impl() override {
    {
      std::lock_guard<std::mutex> lock(mutex);
      shutting_down = true;
    }
    changed.notify_all();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    monitor.join();
    if (http) {
      http->stop();
      http_thread.join();
    }
  }

  spdlog::logger& log() { return options.log ? *options.log : *spdlog::default_logger(); }

  grpc::Status check_token(grpc::ServerContext* context, const char* call) {
    if (authorized(*context, options.token)) return grpc::Status::OK;
    log().warn("coordinator: refused {} from {}: missing or wrong job token", call,
               context->peer());
    return {grpc::StatusCode::UNAUTHENTICATED, "wrong or missing job token (loom-token)"};
  }

  // ---- key-value store ----

  grpc::Status Set(grpc::ServerContext* c, const v1::SetRequest* req, v1::SetReply*) override {
    if (auto s = check_token(c, "Set"); !s.ok()) return s;
    store.set(req->key(), req->value());
    return grpc::Status::OK;
  }

  bool stopping() const {
    std::lock_guard<std::mutex> lock(mutex);
    return shutting_down;
  }

  // Waits for keys in slices until found, the timeout, a cancelled call or shutdown.
  std::vector<std::string> wait_keys(grpc::ServerContext* c, const std::vector<std::string>& keys,
                                     milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      if (store.check(keys)) return {};
      if (util::expired(deadline) || c->IsCancelled() || stopping()) break;
      try {
        store.wait(keys, std::min(util::time_left(deadline), kSlice));
        return {};
      } catch (const Timeout&) {
      }
    }
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!store.check({k})) missing.push_back(k);
    }
    return missing;
  }

  grpc::Status Get(grpc::ServerContext* c, const v1::GetRequest* req,
                   v1::GetReply* reply) override {
    if (auto s = check_token(c, "Get"); !s.ok()) return s;
    if (!wait_keys(c, {req->key()}, rpc_wait(req->timeout_ms())).empty()) return grpc::Status::OK;
    reply->set_found(true);
    reply->set_value(store.get(req->key(), milliseconds(0)));
    return grpc::Status::OK;
  }

  grpc::Status Add(grpc::ServerContext* c, const v1::AddRequest* req,
                   v1::AddReply* reply) override {
    if (auto s = check_token(c, "Add"); !s.ok()) return s;
    try {
      reply->set_value(store.add(req->key(), req->delta()));
    } catch (const InvalidArgument& e) {
      return invalid_argument(e);
    }
    return grpc::Status::OK;
  }

  grpc::Status CompareSet(grpc::ServerContext* c, const v1::CompareSetRequest* req,
                          v1::CompareSetReply* reply) override {
    if (auto s = check_token(c, "CompareSet"); !s.ok()) return s;
    reply->set_value(store.compare_set(req->key(), req->expected(), req->desired()));
    return grpc::Status::OK;
  }

  grpc::Status Wait(grpc::ServerContext* c, const v1::WaitRequest* req,
                    v1::WaitReply* reply) override {
    if (auto s = check_token(c, "Wait"); !s.ok()) return s;
    for (auto& k :
         wait_keys(c, {req->keys().begin(), req->keys().end()}, rpc_wait(req->timeout_ms()))) {
      reply->add_missing(k);
    }
    return grpc::Status::OK;
  }

  grpc::Status Check(grpc::ServerContext* c, const v1::CheckRequest* req,
                     v1::CheckReply* reply) override {
    if (auto s = check_token(c, "Check"); !s.ok()) return s;
    reply->set_all_present(store.check({req->keys().begin(), req->keys().end()}));
    return grpc::Status::OK;
  }

  grpc::Status Remove(grpc::ServerContext* c, const v1::RemoveRequest* req,
                      v1::RemoveReply* reply) override {
    if (auto s = check_token(c, "Remove"); !s.ok()) return s;
    reply->set_existed(store.remove(req->key()));
    return grpc::Status::OK;
  }

  // ---- membership: RPCs in, Membership transitions, RPCs out ----

  // Logs the phase changes of the last transitions and wakes blocked Join calls. mutex held.
  void after_transition() {
    const auto events = membership.take_events();
    if (events.empty()) return;
    for (const auto& event : events) {
      const auto level = event.level == Membership::Event::kError  ? spdlog::level::err
                         : event.level == Membership::Event::kWarn ? spdlog::level::warn
                                                                   : spdlog::level::info;
      log().log(level, "coordinator: {}", event.text);
    }
    changed.notify_all();
  }

  static void fill(const JoinResult& r, v1::JoinReply* reply) {
    reply->set_outcome(to_proto(r.outcome));
    reply->set_reason(r.reason);
    reply->set_exit_code(r.exit_code);
    if (r.outcome != JoinResult::kAdmitted) return;
    reply->set_generation(r.assignment.generation);
    reply->set_node_rank(r.assignment.node_rank);
    reply->set_nnodes(r.assignment.nnodes);
    reply->set_rank_offset(r.assignment.rank_offset);
    reply->set_world_size(r.assignment.world_size);
    reply->set_restarts(r.assignment.restarts);
  }

  // Renews the join every slice until the round admits the node, the job is over, or the
  // call's timeout, cancellation or shutdown (the node keeps its place: it joins again).
  grpc::Status Join(grpc::ServerContext* c, const v1::JoinRequest* req,
                    v1::JoinReply* reply) override {
    if (auto s = check_token(c, "Join"); !s.ok()) return s;
    const auto deadline = Clock::now() + rpc_wait(req->timeout_ms());
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      JoinResult r;
      try {
        r = membership.join(req->node_id(), req->nproc(), req->node_rank_hint());
      } catch (const InvalidArgument& e) {
        return invalid_argument(e);
      }
      after_transition();
      if (r.outcome == JoinResult::kWaiting &&
          (Clock::now() >= deadline || c->IsCancelled() || shutting_down)) {
        r.reason = "the rendezvous did not complete in time: " + r.reason;
      } else if (r.outcome == JoinResult::kWaiting) {
        changed.wait_for(lock, kSlice);
        continue;
      }
      fill(r, reply);
      return grpc::Status::OK;
    }
  }

  grpc::Status Heartbeat(grpc::ServerContext* c, const v1::HeartbeatRequest* req,
                         v1::HeartbeatReply* reply) override {
    if (auto s = check_token(c, "Heartbeat"); !s.ok()) return s;
    const double now = unix_now();
    std::optional<StepPoint> point;
    const RankActivity activity{
        .step = req->step(), .phase = req->phase(), .collective = req->collective()};
    try {
      if (req->rank() >= 0) activity.check();
      if (req->rank() >= 0 && req->has_report() && req->report().steps() > 0) {
        point = to_step_point(req->generation(), req->report(), now);
        point->check();
      }
    } catch (const InvalidArgument& e) {
      return invalid_argument(e);
    }
    std::lock_guard<std::mutex> lock(mutex);
    HeartbeatResult r;
    try {
      r = req->rank() >= 0
              ? membership.worker_heartbeat(req->rank(), req->generation(), req->step(),
                                            req->throughput(), req->state())
              : membership.node_heartbeat(req->node_id(), req->generation());
    } catch (const InvalidArgument& e) {
      return invalid_argument(e);
    }
    if (req->rank() >= 0 && r.state == HeartbeatResult::kRunning &&
        r.generation == req->generation()) {
      job_metrics.observe(req->rank(), req->generation(), activity, now);
      if (point) job_metrics.record(req->rank(), std::move(*point));
      log_metrics_events();
    }
    reply->set_state(to_proto(r.state));
    reply->set_generation(r.generation);
    reply->set_flight_dump_epoch(flight_dump_epoch);
    reply->set_exit_code(r.exit_code);
    reply->set_reason(r.reason);
    return grpc::Status::OK;
  }

  static double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  // Logs what the job metrics noticed: stragglers and hangs. mutex held.
  void log_metrics_events() {
    for (const JobMetrics::Event& event : job_metrics.take_events())
      log().log(event.warning ? spdlog::level::warn : spdlog::level::info, "coordinator: {}",
                event.text);
  }

  grpc::Status ReportFailure(grpc::ServerContext* c, const v1::FailureRequest* req,
                             v1::FailureReply*) override {
    if (auto s = check_token(c, "ReportFailure"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    membership.report_failure(req->generation(), req->exit_code(), req->reason());
    after_transition();
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext* c, const v1::LeaveRequest* req,
                     v1::LeaveReply*) override {
    if (auto s = check_token(c, "Leave"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    if (req->success()) {
      membership.leave(req->node_id(), req->generation());
    } else {  // an agent stops the job (a signal): everyone stops
      membership.stop(req->exit_code(), req->reason());
    }
    after_transition();
    return grpc::Status::OK;
  }

  grpc::Status GetStatus(grpc::ServerContext* c, const v1::StatusRequest*,
                         v1::JobStatus* reply) override {
    if (auto s = check_token(c, "GetStatus"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    const MembershipStatus status = membership.status();
    reply->set_generation(status.generation);
    reply->set_state(to_proto(status.phase));
    reply->set_world_size(status.world_size);
    reply->set_restarts(status.restarts);
    reply->set_last_failure(status.last_failure);
    for (const auto& node : status.nodes) {
      auto* n = reply->add_nodes();
      n->set_node_id(node.node_id);
      n->set_node_rank(node.node_rank);
      n->set_nproc(node.nproc);
      n->set_seconds_since_heartbeat(node.seconds_since_heartbeat);
    }
    for (const auto& worker : status.workers) {
      auto* w = reply->add_workers();
      w->set_rank(worker.rank);
      w->set_step(worker.step);
      w->set_throughput(worker.throughput);
      w->set_state(worker.state);
      w->set_seconds_since_heartbeat(worker.seconds_since_heartbeat);
    }
    return grpc::Status::OK;
  }

  grpc::Status RequestFlightDump(grpc::ServerContext* c, const v1::FlightDumpRequest*,
                                 v1::FlightDumpReply* reply) override {
    if (auto s = check_token(c, "RequestFlightDump"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    reply->set_flight_dump_epoch(++flight_dump_epoch);
    return grpc::Status::OK;
  }

  // Ticks the state machine's clock: silent nodes and workers, expired waiters, last calls.
  void monitor_loop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!shutting_down) {
      changed.wait_for(lock, milliseconds(100));
      membership.tick();
      after_transition();
      // A hung job: every rank dumps its flight recorder (the next heartbeat carries the
      // request), so that `loom flight diff` can compare them.
      if (job_metrics.check_hang(unix_now())) ++flight_dump_epoch;
      log_metrics_events();
    }
  }
};

Coordinator::Coordinator(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Coordinator::~Coordinator() = default;
const std::string& Coordinator::address() const { return impl_->address; }
const std::string& Coordinator::metrics_address() const { return impl_->http_address; }
std::string Coordinator::job_metrics_json() const { return impl_->metrics_json(); }
bool Coordinator::done() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->membership.done();
}

}  // namespace loom::control
