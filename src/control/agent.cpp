// The agent's loop: join a round, run the generation's workers, watch them and the
// coordinator, stop and restart when the generation ends.
#include "loom/control/agent.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include "control/client.h"
#include "control/service_keys.h"
#include "control/service_registry.h"
#include "control/services.h"
#include "control/snapshot_memory.h"
#include "control/snapshot_replication.h"
#include "loom/control/coordinator.h"
#include "loom/control/store.h"
#include "loom/error.h"
#include "util/deadline.h"
#include "util/fd.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom::control {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// "[loom run] ..." lines on stderr: the agent's own voice beside the workers' output.
std::mutex g_output_mutex;
template <typename... Args>
void say(const Args&... args) {
  std::lock_guard<std::mutex> lock(g_output_mutex);
  std::cerr << "[loom run] " << detail::concat(args...) << std::endl;
}

// One worker: its process, the read end of its output pipe, its log file.
struct Worker {
  int rank = 0;
  util::Subprocess process;
  int pipe_fd = -1;
  std::ofstream log;
  std::string partial;  // output after the last newline
  std::optional<util::ExitStatus> status;
};

// Copies the workers' output, line by line, to stdout with a "[rank r] " prefix and to their
// log files, until every pipe is closed (the workers exited).
void pump_output(std::vector<Worker>& workers) {
  std::vector<pollfd> fds;
  for (Worker& w : workers) fds.push_back({w.pipe_fd, POLLIN, 0});
  size_t open = fds.size();
  char buffer[65536];
  while (open > 0) {
    if (::poll(fds.data(), fds.size(), 200) <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      Worker& w = workers[i];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n <= 0) {
        if (!w.partial.empty()) w.partial += "\n";
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      } else {
        w.partial.append(buffer, static_cast<size_t>(n));
      }
      size_t newline;
      std::lock_guard<std::mutex> lock(g_output_mutex);
      while ((newline = w.partial.find('\n')) != std::string::npos) {
        const std::string line = w.partial.substr(0, newline + 1);
        std::cout << "[rank " << w.rank << "] " << line;
        w.log << line;
        w.partial.erase(0, newline + 1);
      }
      std::cout.flush();
      w.log.flush();
    }
  }
}

// The address of this host that faces `coordinator` (host:port): the local end of a UDP
// socket connected towards it (nothing is sent). Workers advertise it to their peers, so that
// collectives work across nodes; "127.0.0.1" when it cannot be found.
std::string advertise_address(const std::string& coordinator) {
  const std::string host = coordinator.substr(0, coordinator.rfind(':'));
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "127.0.0.1";
  std::string address = "127.0.0.1";
  util::UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd.get() >= 0 && ::connect(fd.get(), found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof local;
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr) {
      address = text;
    }
  }
  ::freeaddrinfo(found);
  return address;
}

// A TCP port free on every interface now (bound to port 0, read, released): where rank 0's
// c10d TCPStore will listen. Another process could take it before rank 0 binds it; torchrun
// picks MASTER_PORT the same way.
int free_tcp_port() {
  util::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  LOOM_CHECK_SYS(fd.get(), "creating a socket to pick MASTER_PORT");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  LOOM_CHECK_SYS(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr),
                 "binding a socket to pick MASTER_PORT");
  socklen_t len = sizeof addr;
  LOOM_CHECK_SYS(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len),
                 "reading the port picked for MASTER_PORT");
  return ntohs(addr.sin_port);
}

// torchrun's MASTER_ADDR and MASTER_PORT for one generation.
struct Master {
  std::string addr;
  int port = 0;
};

// "host:port" as node 0 published it; anything else is CorruptData naming the store key.
Master parse_master(const std::string& key, const std::string& value) {
  const auto colon = value.rfind(':');
  int port = -1;
  if (colon != std::string::npos && colon > 0) {
    const std::string digits = value.substr(colon + 1);
    size_t used = 0;
    try {
      port = std::stoi(digits, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != digits.size() || digits.empty()) port = -1;
  }
  LOOM_CHECK(port > 0 && port < 65536, CorruptData, "the coordinator's store holds '", value,
             "' under ", key, "; expected MASTER_ADDR:MASTER_PORT (host:port)");
  return {value.substr(0, colon), port};
}

class Agent {
 public:
  explicit Agent(const AgentOptions& options) : options_(options) {
    LOOM_CHECK(!options.program.empty(), InvalidArgument, "no program to run: give it after --");
    LOOM_CHECK(options.nproc_per_node >= 1, InvalidArgument, "--nproc-per-node must be >= 1, got ",
               options.nproc_per_node);
    LOOM_CHECK(options.min_nodes >= 1 && options.min_nodes <= options.max_nodes, InvalidArgument,
               "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got ", options.min_nodes, ":",
               options.max_nodes);
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    node_id_ = detail::concat(host, ":", ::getpid());
    if (options.host_coordinator || options.coordinator.empty()) {
      coordinator_ = std::make_unique<Coordinator>(CoordinatorOptions{
          .address = options.coordinator.empty() ? "127.0.0.1:0" : options.coordinator,
          .allow_non_loopback = options.coordinator_public,
          .token = options.token,
          .tls = options.tls,
          .min_nodes = options.min_nodes,
          .max_nodes = options.max_nodes,
          .last_call = options.last_call,
          .max_restarts = options.max_restarts,
          .node_timeout = options.node_timeout,
          .worker_timeout = options.worker_timeout,
          .metrics_address = options.metrics_address,
          .run_dir = options.run_dir,
          .straggler_threshold = options.straggler_threshold,
          .straggler_window = options.straggler_window,
          .hang_factor = options.hang_factor,
          .hang_min_seconds = options.hang_min_seconds});
      address_ = coordinator_->address();
      say("coordinator listening on ", address_);
      if (!coordinator_->metrics_address().empty()) {
        say("job dashboard at http://", coordinator_->metrics_address(),
            "/ (metrics: /metrics for Prometheus, /api/metrics as JSON; loom top ",
            coordinator_->metrics_address(), ")");
      }
    } else {
      address_ = options.coordinator;
    }
    client_ = std::make_unique<CoordinatorClient>(address_, options.token, milliseconds(10000),
                                                  options.tls);
    store_ = std::make_unique<CoordinatorStore>(address_, options.token, milliseconds(10000),
                                                options.tls);
    advertise_ = advertise_address(address_);
    std::filesystem::create_directories(options.run_dir / "logs");
    if (!options.snapshot_root.empty()) {
      snapshots_ = std::make_unique<SnapshotMemory>(options.snapshot_root);
      replication_ =
          std::make_unique<SnapshotReplication>(snapshots_->dir(), advertise_, options.token);
      say("in-memory snapshots in ", snapshots_->dir().string(), ", served at ",
          replication_->url(),
          snapshots_->stale_removed() > 0
              ? detail::concat(" (removed ", snapshots_->stale_removed(),
                               " left by agents that died)")
              : std::string());
    }
  }

  int run() {
    int failures_seen = 0;
    for (;;) {
      const std::optional<v1::JoinReply> round = join();
      if (!round) return 128 + g_stop_signal.load();
      if (round->outcome() != v1::JOIN_ADMITTED) return finish_without_round(*round);
      generation_ = round->generation();
      if (first_generation_ == 0) first_generation_ = generation_;
      node_rank_ = round->node_rank();
      nnodes_ = round->nnodes();
      publish_snapshot_server();
      say("generation ", round->generation(), ": node ", round->node_rank(), " of ",
          round->nnodes(), ", ranks ", round->rank_offset(), "-",
          round->rank_offset() + options_.nproc_per_node - 1, " of world size ",
          round->world_size());
      if (const std::optional<int> failed = start_services()) return *failed;
      const Outcome outcome = run_generation(*round);
      if (outcome.exit_code >= 0) {
        if (services_) services_->stop(options_.grace);  // after the workers
        return linger(outcome.exit_code);
      }
      // The generation ended: its services stop with its workers, then re-join, at once the
      // first time (a fast recovery), then after a back-off that grows with repeated failures.
      if (services_) services_->stop_generation(options_.grace);
      std::this_thread::sleep_for(std::min(milliseconds(200) * failures_seen, milliseconds(3000)));
      ++failures_seen;
    }
  }

 private:
  struct Outcome {
    int exit_code = -1;  // >= 0: the job is over for this agent; -1: restart
  };

  // A job spec's services on this node: all of them once, when the node first joins a
  // generation, before its workers; at a later generation the generation-scoped ones again.
  // Without a job spec the job's list of services is published empty (Runtime::service then
  // fails at once). The exit code when they cannot be started (the job fails); else nullopt.
  std::optional<int> start_services() {
    if (!options_.job) {
      if (generation_ == first_generation_) store_->set(kServicesKey, "");
      return std::nullopt;
    }
    const bool first = !services_;
    if (first) {
      services_ = std::make_unique<ServiceSupervisor>(
          *options_.job, static_cast<int>(node_rank_), options_.run_dir, advertise_, options_.token,
          ServiceRegistry::default_dir(),
          [this](const std::string& key, const std::string& value) { store_->set(key, value); },
          [](const std::string& line) { say(line); });
    }
    try {
      if (first) {
        services_->start();
      } else {
        services_->start_generation();
      }
    } catch (const Error& e) {
      say(e.what());
      leave(false, 1, e.what());
      services_->stop(options_.grace);
      return linger(1);
    }
    return std::nullopt;
  }

  // Joins the next rendezvous round, in short calls so that a stop signal is seen at once.
  // The reply is admitted, the job over, or still waiting at the rendezvous deadline; nullopt
  // when a signal stopped the wait.
  std::optional<v1::JoinReply> join() {
    const auto deadline = Clock::now() + options_.rendezvous_timeout;
    for (;;) {
      if (g_stop_signal.load() != 0) {
        say("received signal ", g_stop_signal.load(),
            " while waiting for the other nodes: stopping");
        return std::nullopt;
      }
      const bool last = util::expired(deadline);  // one more Join, then give up
      v1::JoinRequest request;
      request.set_node_id(node_id_);
      request.set_nproc(options_.nproc_per_node);
      request.set_node_rank_hint(options_.node_rank);
      request.set_timeout_ms(std::min(util::time_left(deadline), milliseconds(1000)).count());
      v1::JoinReply reply =
          client_->call("Join", &CoordinatorClient::Stub::Join, request, milliseconds(1000));
      if (reply.outcome() != v1::JOIN_WAITING || last) return reply;
    }
  }

  // The generation's MASTER_ADDR:MASTER_PORT. Node 0 (it runs global rank 0) picks a free port
  // on its own address and publishes both in the coordinator's store under a key of this
  // generation; the other nodes read them there, so every worker of a generation gets the
  // same endpoint. Nothing listens there until rank 0's process creates the TCPStore
  // (init_process_group's env:// does, with TORCHELASTIC_USE_AGENT_STORE=False).
  Master publish_master(const v1::JoinReply& round) {
    const std::string key = detail::concat("loom/torchrun/generation_", round.generation());
    if (round.node_rank() == 0) {
      Master m{advertise_, free_tcp_port()};
      store_->set(key, detail::concat(m.addr, ":", m.port));
      return m;
    }
    const auto deadline = Clock::now() + options_.rendezvous_timeout;
    for (;;) {
      try {
        return parse_master(key, store_->get(key, milliseconds(1000)));
      } catch (const Timeout&) {
        LOOM_CHECK(g_stop_signal.load() == 0, Error, "stopped by signal ", g_stop_signal.load(),
                   " while waiting for node 0's MASTER_ADDR:MASTER_PORT");
        LOOM_CHECK(Clock::now() < deadline, Timeout,
                   "node 0 did not publish MASTER_ADDR:MASTER_PORT of generation ",
                   round.generation(), " within ", options_.rendezvous_timeout.count(), " ms");
      }
    }
  }

  std::map<std::string, std::string> worker_env(const v1::JoinReply& round, const Master& master,
                                                int local_rank) const {
    const int rank = round.rank_offset() + local_rank;
    const auto s = [](auto v) { return std::to_string(v); };
    std::map<std::string, std::string> env = {
        {"LOOM_RANK", s(rank)},
        {"LOOM_WORLD_SIZE", s(round.world_size())},
        {"LOOM_LOCAL_RANK", s(local_rank)},
        {"LOOM_LOCAL_WORLD_SIZE", s(options_.nproc_per_node)},
        {"LOOM_NODE_RANK", s(round.node_rank())},
        {"LOOM_NNODES", s(round.nnodes())},
        {"LOOM_COORDINATOR", address_},
        {"LOOM_GENERATION", s(round.generation())},
        {"LOOM_RESTART_COUNT", s(round.restarts())},
        {"LOOM_JOB_TOKEN", options_.token},
        {"LOOM_RUN_DIR", options_.run_dir.string()},
        {"LOOM_ADVERTISE_ADDR", advertise_},
        {"LOOM_SNAPSHOT_DIR", snapshots_ ? snapshots_->dir().string() : ""},
        // torchrun's environment (torch/distributed/elastic/agent/server/
        // local_elastic_agent.py), one role named "default": a PyTorch program's
        // init_process_group() with env:// works unchanged. Not an agent store: rank 0
        // hosts the TCPStore at MASTER_ADDR:MASTER_PORT (a fresh port per generation).
        {"RANK", s(rank)},
        {"WORLD_SIZE", s(round.world_size())},
        {"LOCAL_RANK", s(local_rank)},
        {"LOCAL_WORLD_SIZE", s(options_.nproc_per_node)},
        {"GROUP_RANK", s(round.node_rank())},
        {"GROUP_WORLD_SIZE", s(round.nnodes())},
        {"ROLE_NAME", "default"},
        {"ROLE_RANK", s(rank)},
        {"ROLE_WORLD_SIZE", s(round.world_size())},
        {"MASTER_ADDR", master.addr},
        {"MASTER_PORT", s(master.port)},
        {"TORCHELASTIC_RESTART_COUNT", s(round.restarts())},
        {"TORCHELASTIC_MAX_RESTARTS", s(options_.max_restarts)},
        {"TORCHELASTIC_RUN_ID", options_.run_id},
        {"TORCHELASTIC_USE_AGENT_STORE", "False"}};
    if (services_) {  // this node's services (discovery across nodes: the store)
      for (const auto& [name, value] : services_->env()) env[name] = value;
    }
    if (options_.tls.enabled()) {  // the workers' store and heartbeat need them too
      env["LOOM_TLS_CERT"] = options_.tls.cert.string();
      env["LOOM_TLS_KEY"] = options_.tls.key.string();
      env["LOOM_TLS_CA"] = options_.tls.ca.string();
    }
    // torchrun's default: one OpenMP thread per worker when several share the node and the
    // user chose nothing (each worker would otherwise start one thread per core).
    if (std::getenv("OMP_NUM_THREADS") == nullptr && options_.nproc_per_node > 1)
      env["OMP_NUM_THREADS"] = "1";
    return env;
  }

  std::string snapshot_key(int64_t node) const {
    return detail::concat("loom/snapshots/generation_", generation_, "/node_", node);
  }

  // Publishes this node's snapshot server for the generation; its peers are found by
  // follow_snapshot_peers() once they have published theirs.
  void publish_snapshot_server() {
    followed_ = !replication_ || nnodes_ == 1;
    if (replication_) {
      replication_->follow("", "");  // the old generation's peers may be gone
      store_->set(snapshot_key(node_rank_), replication_->url());
    }
  }

  // Node n copies node n - 1's snapshot files and node 0's manifests (SnapshotReplication);
  // called from the watch loop until both have published their servers.
  void follow_snapshot_peers() {
    if (followed_) return;
    const int64_t predecessor = (node_rank_ + nnodes_ - 1) % nnodes_;
    if (!store_->check({snapshot_key(predecessor), snapshot_key(0)})) return;
    const std::string from = store_->get(snapshot_key(predecessor), milliseconds(1000));
    const std::string manifests =
        node_rank_ == 0 ? "" : store_->get(snapshot_key(0), milliseconds(1000));
    replication_->follow(from, manifests);
    followed_ = true;
  }

  std::vector<Worker> spawn_workers(const v1::JoinReply& round) {
    const Master master = publish_master(round);
    std::vector<Worker> workers;
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      int fds[2];
      LOOM_CHECK_SYS(::pipe2(fds, O_CLOEXEC), "creating a pipe for a worker's output");
      util::UniqueFd write_end(fds[1]);
      Worker w{round.rank_offset() + local,
               util::Subprocess::spawn({.argv = options_.program,
                                        .env = worker_env(round, master, local),
                                        .output_fd = fds[1]}),
               fds[0]};
      w.log.open(options_.run_dir / "logs" / detail::concat("worker_", w.rank, ".out"),
                 std::ios::app);
      w.log << "---- generation " << round.generation() << " ----\n";
      workers.push_back(std::move(w));
    }
    return workers;
  }

  // Stops every worker still running: SIGTERM, then SIGKILL after the grace period.
  void stop_workers(std::vector<Worker>& workers) {
    for (Worker& w : workers) {
      if (!w.status) w.process.signal(SIGTERM);
    }
    const auto deadline = Clock::now() + options_.grace;
    for (Worker& w : workers) {
      if (w.status) continue;
      w.status = w.process.wait_for(util::time_left(deadline));
      if (!w.status) {
        say("rank ", w.rank, " did not stop within ", options_.grace.count(), " ms: SIGKILL");
        w.process.signal(SIGKILL);
        w.status = w.process.wait();
      }
    }
  }

  // Runs one generation's workers until it is over for this node. Whatever ends it, an
  // exception included, the workers are stopped and the output pump joined before returning
  // (a joinable std::thread destroyed by unwinding would be std::terminate).
  Outcome run_generation(const v1::JoinReply& round) {
    std::vector<Worker> workers = spawn_workers(round);
    std::thread pump([&workers] { pump_output(workers); });
    Outcome outcome;
    try {
      outcome = watch(workers);
    } catch (...) {
      stop_workers(workers);
      pump.join();
      throw;
    }
    stop_workers(workers);
    pump.join();
    return outcome;
  }

  // Watches the workers and the coordinator until this generation is over for this node.
  Outcome watch(std::vector<Worker>& workers) {
    bool left = false;
    for (;;) {
      if (const int sig = g_stop_signal.load()) {
        say("received signal ", sig, ": stopping the job");
        leave(false, 128 + sig,
              detail::concat("loom run on node ", node_id_, " received signal ", sig));
        return {128 + sig};
      }
      int running = 0;
      for (Worker& w : workers) {
        if (!w.status) w.status = w.process.wait_for(milliseconds(0));
        if (!w.status) {
          ++running;
        } else if (!w.status->ok() && !failure_reported_) {
          failure_reported_ = true;
          const std::string reason = detail::concat("rank ", w.rank, " ", w.status->describe());
          say(reason);
          report_failure(w.status->code > 0 ? w.status->code : 128 + w.status->signal, reason);
        }
      }
      if (running == 0 && !left && !failure_reported_) {
        leave(true, 0, "");
        left = true;
      }
      if (services_ && !left) {
        if (const auto down = services_->poll()) {
          say(*down, ": the job fails");
          leave(false, 1, *down);
          return {1};
        }
      }
      try {
        follow_snapshot_peers();
      } catch (const Error& e) {
        say("snapshot replication: cannot find the peers' servers: ", e.what());
        followed_ = true;  // this generation runs without replication
      }
      v1::HeartbeatRequest beat;
      beat.set_node_id(node_id_);
      beat.set_rank(-1);
      beat.set_generation(generation_);
      v1::HeartbeatReply reply;
      try {
        reply = client_->call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat);
      } catch (const Error& e) {
        say("lost the coordinator: ", e.what());
        return {1};
      }
      switch (reply.state()) {
        case v1::FINISHED:
          return {0};
        case v1::FAILED:
          say("the job failed: ", reply.reason());
          return {reply.exit_code() != 0 ? reply.exit_code() : 1};
        case v1::ENDED:
          say("generation ", generation_, " ended (", reply.reason(), "): restarting the workers");
          failure_reported_ = false;
          return {};
        default:
          break;
      }
      save_job_metrics(false);
      wait_for_exit_or_beat(workers);
    }
  }

  // The node hosting the coordinator saves the job's metrics to <run_dir>/job_metrics.json
  // (what /api/metrics serves; `loom top RUN_DIR` reads it): every 5 s while the job runs,
  // and at the end. Observability only: a failed write is said, not thrown.
  void save_job_metrics(bool at_end) {
    if (!coordinator_ || (!at_end && Clock::now() < next_metrics_save_)) return;
    next_metrics_save_ = Clock::now() + std::chrono::seconds(5);
    try {
      util::write_file_atomic(options_.run_dir / "job_metrics.json",
                              coordinator_->job_metrics_json(), util::Durability::kAtomicOnly);
    } catch (const Error& e) {
      say("could not save the job's metrics: ", e.what());
    }
  }

  // Until the next heartbeat is due, looks at the workers every 20 ms and returns early when
  // one has exited (or a stop signal came): a failure is reported at once, not up to a
  // heartbeat interval later, which is most of a fast recovery's time.
  void wait_for_exit_or_beat(std::vector<Worker>& workers) {
    const auto beat = Clock::now() + options_.heartbeat_interval;
    while (Clock::now() < beat && g_stop_signal.load() == 0) {
      for (Worker& w : workers) {
        if (!w.status && (w.status = w.process.wait_for(milliseconds(0)))) return;
      }
      std::this_thread::sleep_for(std::min(
          milliseconds(20),
          std::chrono::duration_cast<milliseconds>(beat - Clock::now()) + milliseconds(1)));
    }
  }

  // A coordinator that cannot be told is said, not thrown: the next heartbeat finds out what
  // it means (lost: the agent exits 1).
  void report_failure(int code, const std::string& reason) {
    v1::FailureRequest req;
    req.set_node_id(node_id_);
    req.set_generation(generation_);
    req.set_exit_code(code);
    req.set_reason(reason);
    try {
      client_->call("ReportFailure", &CoordinatorClient::Stub::ReportFailure, req);
    } catch (const Error& e) {
      say("could not report the failure to the coordinator: ", e.what());
    }
  }

  void leave(bool success, int code, const std::string& reason) {
    v1::LeaveRequest req;
    req.set_node_id(node_id_);
    req.set_generation(generation_);
    req.set_success(success);
    req.set_exit_code(code);
    req.set_reason(reason);
    try {
      client_->call("Leave", &CoordinatorClient::Stub::Leave, req);
    } catch (const Error& e) {
      say("could not tell the coordinator: ", e.what());
    }
  }

  int finish_without_round(const v1::JoinReply& reply) {
    switch (reply.outcome()) {
      case v1::JOIN_JOB_FINISHED:
        return linger(0);
      case v1::JOIN_JOB_FAILED:
        say("not admitted to a generation: ", reply.reason());
        return linger(reply.exit_code() != 0 ? reply.exit_code() : 1);
      default:  // still waiting at the rendezvous deadline
        say("not admitted to a generation: ", reply.reason());
        return linger(1);
    }
  }

  // The node hosting the coordinator stays up a little so the other agents hear the outcome.
  int linger(int code) {
    save_job_metrics(true);
    if (coordinator_) std::this_thread::sleep_for(options_.heartbeat_interval * 3);
    return code;
  }

  // Constant after construction.
  const AgentOptions& options_;
  std::string node_id_;
  std::string address_;
  std::string advertise_;  // this node's address towards the coordinator, for the workers
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorClient> client_;
  std::unique_ptr<CoordinatorStore> store_;           // MASTER_ADDR:MASTER_PORT per generation
  std::unique_ptr<SnapshotMemory> snapshots_;         // null without snapshots
  std::unique_ptr<SnapshotReplication> replication_;  // null without snapshots
  std::unique_ptr<ServiceSupervisor> services_;       // a job spec's services on this node
  // Owned by the agent's thread.
  int64_t generation_ = 0;
  int64_t first_generation_ = 0;  // the first this node joined
  int64_t node_rank_ = 0;
  int64_t nnodes_ = 1;
  bool followed_ = true;  // this generation's snapshot peers are followed (or there are none)
  bool failure_reported_ = false;
  Clock::time_point next_metrics_save_{};  // when save_job_metrics writes again
};

}  // namespace

int run_agent(const AgentOptions& options) {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  Agent agent(options);
  return agent.run();
}

}  // namespace loom::control
