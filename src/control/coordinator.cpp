// The coordinator's gRPC service: the key-value store (an InMemoryStore behind RPCs), the
// rendezvous rounds of the agents, heartbeats, and the monitor that ends a generation when a
// node or a worker goes silent.
#include "loom/control/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "control/auth.h"
#include "loom.grpc.pb.h"
#include "loom/comm/store.h"
#include "loom/error.h"

namespace loom::control {
namespace {

namespace v1 = loom::control::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Blocking store calls wait in slices so that a cancelled call or a shutdown frees its thread.
constexpr milliseconds kSlice{200};
// Workers one node may run (the launcher's --nproc-per-node bound).
constexpr int kMaxNproc = 4096;

// A client's timeout_ms as a wait: negative is 0, and at most a day, so that adding it to
// Clock::now() cannot overflow (INT64_MAX ms is past the clock's range).
milliseconds rpc_wait(int64_t timeout_ms) {
  return milliseconds(std::clamp<int64_t>(timeout_ms, 0, int64_t{24} * 3600 * 1000));
}

bool is_loopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "[::1]" || host == "::1";
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
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

  comm::InMemoryStore store;  // thread-safe on its own

  struct Member {
    std::string node_id;
    int node_rank = 0;
    int nproc = 0;
    int rank_offset = 0;
    Clock::time_point last_heartbeat;
    bool left = false;
  };
  // An agent waiting for the next round. Agents wait in short Join calls; an entry not
  // renewed for kWaitingExpiry belongs to an agent that went away.
  struct Waiting {
    int nproc = 0;
    int hint = -1;
    Clock::time_point seen;
  };
  static constexpr milliseconds kWaitingExpiry{3000};
  struct Worker {
    int64_t step = 0;
    double throughput = 0;
    std::string state;
    Clock::time_point last_heartbeat;
  };

  // State below is protected by mutex; changed is notified on every membership change.
  mutable std::mutex mutex;
  std::condition_variable changed;
  bool shutting_down = false;
  int64_t generation = 0;                 // 0 until the first round closes
  v1::GenerationState state = v1::ENDED;  // ENDED = gathering the next round
  std::map<std::string, Waiting> waiting;
  std::optional<Clock::time_point> round_deadline;
  std::map<std::string, v1::JoinReply> assigned;  // this generation's replies, by node id
  std::vector<Member> members;
  std::map<int, Worker> workers;
  int restarts = 0;
  int world_size = 0;
  int exit_code = 0;
  std::string last_failure;
  int64_t flight_dump_epoch = 0;

  std::unique_ptr<grpc::Server> server;
  std::thread monitor;

  explicit Impl(CoordinatorOptions opts) : options(std::move(opts)) {
    LOOM_CHECK(options.min_nodes >= 1 && options.max_nodes >= options.min_nodes, InvalidArgument,
               "nodes must satisfy 1 <= min <= max, got ", options.min_nodes, ":",
               options.max_nodes);
    LOOM_CHECK(options.max_restarts >= 0, InvalidArgument, "max_restarts must be >= 0");
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
    builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    grpc::ResourceQuota quota("loom-coordinator");
    quota.SetMaxThreads(512);
    builder.SetResourceQuota(quota);
    server = builder.BuildAndStart();
    LOOM_CHECK(server != nullptr && port != 0, IoError, "the coordinator cannot listen on ",
               options.address, " (address in use or not local?)");
    address = options.address.substr(0, options.address.rfind(':') + 1) + std::to_string(port);
    monitor = std::thread([this] { monitor_loop(); });
  }

  ~Impl() override {
    {
      std::lock_guard<std::mutex> lock(mutex);
      shutting_down = true;
    }
    changed.notify_all();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    monitor.join();
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

  // Waits for keys in slices until found, the timeout, a cancelled call or shutdown.
  std::vector<std::string> wait_keys(grpc::ServerContext* c, const std::vector<std::string>& keys,
                                     milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      if (store.check(keys)) return {};
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left <= milliseconds(0) || c->IsCancelled() || stopping()) break;
      try {
        store.wait(keys, std::min(left, kSlice));
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
      return {grpc::StatusCode::INVALID_ARGUMENT, e.what()};
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

  // ---- membership ----

  bool stopping() const {
    std::lock_guard<std::mutex> lock(mutex);
    return shutting_down;
  }

  bool job_over() const { return state == v1::FINISHED || state == v1::FAILED; }

  // Closes the gathering round: the waiting agents become the next generation. mutex held.
  void close_round() {
    std::vector<std::pair<std::string, Waiting>> nodes(waiting.begin(), waiting.end());
    std::sort(nodes.begin(), nodes.end(), [](const auto& a, const auto& b) {
      const int ha = a.second.hint < 0 ? INT32_MAX : a.second.hint;
      const int hb = b.second.hint < 0 ? INT32_MAX : b.second.hint;
      return ha != hb ? ha < hb : a.first < b.first;
    });
    if (static_cast<int>(nodes.size()) > options.max_nodes)
      nodes.resize(static_cast<size_t>(options.max_nodes));
    ++generation;
    members.clear();
    assigned.clear();
    workers.clear();
    int offset = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
      members.push_back(
          {nodes[i].first, static_cast<int>(i), nodes[i].second.nproc, offset, Clock::now()});
      offset += nodes[i].second.nproc;
    }
    world_size = offset;
    for (const Member& m : members) {
      v1::JoinReply& r = assigned[m.node_id];
      r.set_admitted(true);
      r.set_generation(generation);
      r.set_node_rank(m.node_rank);
      r.set_nnodes(static_cast<int>(members.size()));
      r.set_rank_offset(m.rank_offset);
      r.set_world_size(world_size);
      r.set_restarts(restarts);
      waiting.erase(m.node_id);
    }
    round_deadline.reset();
    state = v1::RUNNING;
    log().info("coordinator: generation {} starts: {} node(s), world size {}", generation,
               members.size(), world_size);
    changed.notify_all();
  }

  // Ends the running generation; the agents see ENDED (or FAILED) in their next heartbeat.
  void end_generation(const std::string& reason, int code, bool failure) {
    if (state != v1::RUNNING) return;
    last_failure = reason;
    if (failure) {
      ++restarts;
      if (exit_code == 0) exit_code = code != 0 ? code : 1;
    }
    if (failure && restarts > options.max_restarts) {
      state = v1::FAILED;
      log().error("coordinator: generation {} ended: {}; restarts exhausted ({}), the job fails",
                  generation, reason, options.max_restarts);
    } else {
      state = v1::ENDED;
      log().warn("coordinator: generation {} ended: {}; {}", generation, reason,
                 failure ? "restart " + std::to_string(restarts) + " of " +
                               std::to_string(options.max_restarts)
                         : std::string("re-rendezvous"));
    }
    changed.notify_all();
  }

  grpc::Status Join(grpc::ServerContext* c, const v1::JoinRequest* req,
                    v1::JoinReply* reply) override {
    if (auto s = check_token(c, "Join"); !s.ok()) return s;
    // A node's count and hint become ranks and the world size: refuse what cannot be one.
    if (req->node_id().empty() || req->node_id().size() > 1024 || req->nproc() < 1 ||
        req->nproc() > kMaxNproc || req->node_rank_hint() < -1) {
      return {grpc::StatusCode::INVALID_ARGUMENT,
              detail::concat("Join from node '", req->node_id().substr(0, 64), "': nproc ",
                             req->nproc(), " must be in [1, ", kMaxNproc, "], node_rank_hint ",
                             req->node_rank_hint(), " >= -1, and the node id 1 to 1024 bytes")};
    }
    const auto deadline = Clock::now() + rpc_wait(req->timeout_ms());
    std::unique_lock<std::mutex> lock(mutex);
    if (auto it = assigned.find(req->node_id()); it != assigned.end() && state == v1::RUNNING) {
      *reply = it->second;  // the round closed between two of this agent's Join calls
      return grpc::Status::OK;
    }
    waiting[req->node_id()] = {req->nproc(), req->node_rank_hint(), Clock::now()};
    changed.notify_all();
    for (;;) {
      if (job_over()) {
        waiting.erase(req->node_id());
        reply->set_reason(state == v1::FINISHED ? "the job already finished"
                                                : "the job failed: " + last_failure);
        return grpc::Status::OK;
      }
      auto it = assigned.find(req->node_id());
      if (it != assigned.end() && state == v1::RUNNING) {
        *reply = it->second;
        return grpc::Status::OK;
      }
      if (state != v1::RUNNING && static_cast<int>(waiting.size()) >= options.min_nodes) {
        if (static_cast<int>(waiting.size()) >= options.max_nodes) {
          close_round();
          continue;
        }
        if (!round_deadline) round_deadline = Clock::now() + options.last_call;
      }
      if (Clock::now() >= deadline || c->IsCancelled() || shutting_down) {
        // Stays in `waiting` (kWaitingExpiry) so that the next Join call keeps its place.
        reply->set_reason(
            "the rendezvous did not complete in time: " + std::to_string(waiting.size()) +
            " node(s) joined, at least " + std::to_string(options.min_nodes) + " needed");
        return grpc::Status::OK;
      }
      waiting[req->node_id()].seen = Clock::now();
      changed.wait_for(lock, kSlice);
    }
  }

  grpc::Status Heartbeat(grpc::ServerContext* c, const v1::HeartbeatRequest* req,
                         v1::HeartbeatReply* reply) override {
    if (auto s = check_token(c, "Heartbeat"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    if (req->rank() >= world_size && req->generation() == generation) {
      return {grpc::StatusCode::INVALID_ARGUMENT,
              detail::concat("Heartbeat from rank ", req->rank(), " of generation ", generation,
                             ", whose world size is ", world_size)};
    }
    if (req->generation() == generation && state == v1::RUNNING) {
      if (req->rank() >= 0) {
        Worker& w = workers[req->rank()];
        w.step = req->step();
        w.throughput = req->throughput();
        w.state = req->state();
        w.last_heartbeat = Clock::now();
      } else {
        for (Member& m : members) {
          if (m.node_id == req->node_id()) m.last_heartbeat = Clock::now();
        }
      }
    }
    const bool current = req->generation() == generation;
    reply->set_state(job_over()                        ? state
                     : current && state == v1::RUNNING ? v1::RUNNING
                                                       : v1::ENDED);
    reply->set_generation(generation);
    reply->set_flight_dump_epoch(flight_dump_epoch);
    reply->set_exit_code(exit_code);
    reply->set_reason(last_failure);
    return grpc::Status::OK;
  }

  grpc::Status ReportFailure(grpc::ServerContext* c, const v1::FailureRequest* req,
                             v1::FailureReply*) override {
    if (auto s = check_token(c, "ReportFailure"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    if (req->generation() == generation) end_generation(req->reason(), req->exit_code(), true);
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext* c, const v1::LeaveRequest* req,
                     v1::LeaveReply*) override {
    if (auto s = check_token(c, "Leave"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    if (!req->success()) {  // an agent stops the job (a signal): everyone stops
      if (!job_over()) {
        state = v1::FAILED;
        exit_code = req->exit_code();
        last_failure = req->reason();
        log().warn("coordinator: the job stops: {}", req->reason());
      }
    } else if (req->generation() == generation) {
      bool all = true;
      for (Member& m : members) {
        if (m.node_id == req->node_id()) m.left = true;
        all = all && m.left;
      }
      if (all && state == v1::RUNNING) {
        state = v1::FINISHED;
        log().info("coordinator: generation {} finished; the job is done", generation);
      }
    }
    changed.notify_all();
    return grpc::Status::OK;
  }

  grpc::Status GetStatus(grpc::ServerContext* c, const v1::StatusRequest*,
                         v1::JobStatus* reply) override {
    if (auto s = check_token(c, "GetStatus"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mutex);
    reply->set_generation(generation);
    reply->set_state(state);
    reply->set_world_size(world_size);
    reply->set_restarts(restarts);
    reply->set_last_failure(last_failure);
    for (const Member& m : members) {
      auto* n = reply->add_nodes();
      n->set_node_id(m.node_id);
      n->set_node_rank(m.node_rank);
      n->set_nproc(m.nproc);
      n->set_seconds_since_heartbeat(seconds_since(m.last_heartbeat));
    }
    for (const auto& [rank, w] : workers) {
      auto* s = reply->add_workers();
      s->set_rank(rank);
      s->set_step(w.step);
      s->set_throughput(w.throughput);
      s->set_state(w.state);
      s->set_seconds_since_heartbeat(seconds_since(w.last_heartbeat));
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

  // Ends generations whose nodes or workers went silent; closes rounds at their deadline.
  void monitor_loop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!shutting_down) {
      changed.wait_for(lock, milliseconds(100));
      if (state == v1::RUNNING) {
        for (const Member& m : members) {
          if (!m.left && Clock::now() - m.last_heartbeat > options.node_timeout) {
            end_generation("node " + std::to_string(m.node_rank) + " (" + m.node_id +
                               ") lost: no heartbeat for " +
                               std::to_string(options.node_timeout.count()) + " ms",
                           1, false);
            break;
          }
        }
      }
      if (state == v1::RUNNING) {
        for (const auto& [rank, w] : workers) {
          if (Clock::now() - w.last_heartbeat > options.worker_timeout) {
            end_generation("rank " + std::to_string(rank) + " missed heartbeats for " +
                               std::to_string(options.worker_timeout.count()) +
                               " ms (hung or dead)",
                           1, true);
            break;
          }
        }
      }
      for (auto it = waiting.begin(); it != waiting.end();) {
        it = Clock::now() - it->second.seen > kWaitingExpiry ? waiting.erase(it) : std::next(it);
      }
      if (state == v1::ENDED && round_deadline && Clock::now() >= *round_deadline &&
          static_cast<int>(waiting.size()) >= options.min_nodes) {
        close_round();
      }
    }
  }
};

Coordinator::Coordinator(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Coordinator::~Coordinator() = default;
const std::string& Coordinator::address() const { return impl_->address; }
bool Coordinator::done() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->job_over();
}

}  // namespace loom::control
