// `loom run` end to end with real processes: agents, the coordinator, workers that
// rendezvous and all-reduce through it, restarts after a SIGKILL, elastic shrinking when a
// node's agent dies, job tokens, and argument errors. Timings are printed, not asserted
// tightly: they are figures for docs/launcher.md.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "harness/certs.h"
#include "harness/harness.h"
#include "harness/network_namespaces.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
using testing::TempDir;

const std::string kLoom = LOOM_BINARY_DIR "/tools/loom/loom";
const std::string kProbe = LOOM_BINARY_DIR "/tests/loom_launch_probe";

// A free TCP port on loopback (bound, read, released).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct Launch {
  util::Subprocess process;
  fs::path output;
  std::string text() const { return fs::exists(output) ? util::read_file(output) : ""; }
};

Launch launch(const TempDir& dir, const std::string& name, std::vector<std::string> args,
              const std::vector<std::string>& probe_args,
              std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv = {kLoom, "run", "--run-dir", (dir / "run").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back("--");
  argv.push_back(kProbe);
  argv.insert(argv.end(), probe_args.begin(), probe_args.end());
  const fs::path output = dir / (name + ".out");
  return {util::Subprocess::spawn({.argv = argv, .env = env, .output = output}), output};
}

// The probe records of a generation, once `count` ranks wrote theirs (or the timeout).
std::vector<json> wait_probes(const TempDir& dir, int generation, int count,
                              std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::vector<json> found;
    for (int r = 0; r < 16; ++r) {
      const fs::path f =
          dir / "run" / "probe" /
          ("gen" + std::to_string(generation) + "_rank" + std::to_string(r) + ".json");
      if (fs::exists(f)) found.push_back(json::parse(util::read_file(f)));
    }
    if (static_cast<int>(found.size()) >= count || Clock::now() > deadline) return found;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Every launcher test needs the gRPC control plane.
class Launcher : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!LOOM_WITH_GRPC) GTEST_SKIP() << "built with LOOM_WITH_GRPC=OFF";
  }
};

int finish(Launch& l, std::chrono::seconds timeout = std::chrono::seconds(60)) {
  auto status = l.process.wait_for(timeout);
  if (!status) {
    l.process.signal(SIGKILL);
    ADD_FAILURE() << "loom run did not finish; its output:\n" << l.text();
    return -1;
  }
  return status->signal ? 128 + status->signal : status->code;
}

// Under Slurm (one `loom run` per node, started by srun) the layout comes from Slurm's
// environment: the node count, this node's rank, the workers per node ("2(x1)") and the
// coordinator on the first host of the node list, at Slurm's conventional port.
TEST_F(Launcher, SlurmsEnvironmentGivesTheLayout) {
  TempDir dir;
  Launch job = launch(dir, "job", {}, {},
                      {{"SLURM_JOB_ID", "7"},
                       {"SLURM_NODEID", "0"},
                       {"SLURM_NNODES", "1"},
                       {"SLURM_NTASKS_PER_NODE", "2(x1)"},
                       {"SLURM_JOB_NODELIST", "127.0.0.[1-2,5]"}});
  ASSERT_EQ(finish(job), 0) << job.text();
  const std::string out = job.text();
  EXPECT_NE(out.find("[loom run] coordinator listening on 127.0.0.1:29400\n"), std::string::npos)
      << out;
  EXPECT_NE(out.find("[loom run] generation 1: node 0 of 1, ranks 0-1 of world size 2\n"),
            std::string::npos)
      << out;
  const auto probes = wait_probes(dir, 1, 2, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 2u) << out;
  for (const json& p : probes) {
    EXPECT_EQ(p["world"], 2);
    EXPECT_EQ(p["sum"], 3.0);
  }
}

TEST_F(Launcher, OneNodeTwoWorkersRendezvousAndAllReduce) {
  TempDir dir;
  Launch job = launch(dir, "job", {"--nproc-per-node", "2"}, {});
  ASSERT_EQ(finish(job), 0) << job.text();
  const auto probes = wait_probes(dir, 1, 2, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 2u) << job.text();
  for (const json& p : probes) {
    EXPECT_EQ(p["world"], 2);
    EXPECT_EQ(p["sum"], 3.0);
  }
  EXPECT_NE(job.text().find("[rank 1] "), std::string::npos) << job.text();
  EXPECT_TRUE(fs::exists(dir / "run" / "logs" / "worker_1.out"));
}

// `loom run --job`: a spec with only a training group runs it (its command, procs_per_node);
// `--check` prints the plan of a spec with services; a bad spec names file, line and key.
TEST_F(Launcher, AJobSpecRunsItsTrainingGroupAndChecksServices) {
  TempDir dir;
  const fs::path job = dir / "job.toml";
  std::ofstream(job) << "[group.train]\nkind = \"training\"\ncommand = [\"" << kProbe
                     << "\", \"--probe.service=nope\"]\nprocs_per_node = 2\n";
  auto run =
      testing::run_loom(dir, {"run", "--run-dir", (dir / "run").string(), "--job", job.string()});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto probes = wait_probes(dir, 1, 2, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 2u) << run.output;
  for (const json& p : probes) {
    EXPECT_EQ(p["world"], 2);
    // rt.service() of a name the job has no service of: at once, naming what there is.
    EXPECT_EQ(p["service"],
              "error: no service named 'nope' in the job; its services: none (start it with "
              "`loom run --job FILE`)");
  }

  const fs::path services = dir / "services.toml";
  std::ofstream(services) << "[group.train]\nkind = \"training\"\ncommand = [\"prog\"]\n"
                             "after = [\"data\"]\n[group.data]\ncommand = [\"serve\"]\n"
                             "replicas = 2\nplacement = \"spread\"\nhealth = { tcp = 7000 }\n";
  run = testing::run_loom(dir, {"run", "--job", services.string(), "--check"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(run.output, services.string() +
                            ": 2 group(s) on 1 node(s); start order: data train\n"
                            "  data: serve\n"
                            "    2 replica(s) spread, restart on-failure (at most 3, backoff 1 "
                            "s), scope job, health tcp port 7000-7001\n"
                            "  train (training): prog\n"
                            "    1 per node, restart on-failure (at most 3, backoff 1 s), scope "
                            "generation, health none (ready once started), after data\n"
                            "  node 0: data/0 data/1 train/0\n");
  std::ofstream(services) << "[group.train]\nkind = \"trainer\"\n";
  run = testing::run_loom(dir, {"run", "--job", services.string(), "--check"});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(testing::contains(run.output, services.string() +
                                                ":2: group.train.kind: is \"trainer\"; use "
                                                "\"training\" or \"service\""))
      << run.output;
}

// This node's entry for `service` in <run_dir>/services_node0.json, once `ready(entry)`.
json wait_service(const TempDir& dir, const std::string& service,
                  const std::function<bool(const json&)>& ready) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  json last;
  while (Clock::now() < deadline) {
    const fs::path file = dir / "run" / "services_node0.json";
    if (fs::exists(file)) {
      for (const json& entry : json::parse(util::read_file(file))) {
        if (entry["service"] == service) last = entry;
      }
      if (!last.is_null() && ready(last)) return last;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "service " << service << " never reached the state; last seen: " << last;
  return last;
}

// A job with a service (Python's HTTP server, health: its HTTP port) the training workers wait
// for: the workers get its endpoint; SIGKILLed, the service restarts alone (the workers keep
// their generation); a SIGKILLed worker restarts training while the service keeps its pid; at
// the end the service is stopped after the workers, and its log holds each start.
TEST_F(Launcher, AServiceRestartsAloneAndOutlivesTrainingRestarts) {
  TempDir dir;
  const int port = free_port();
  const fs::path job = dir / "job.toml";
  std::ofstream(job) << "[group.web]\ncommand = [\"python3\", \"-m\", \"http.server\", \"" << port
                     << "\", \"--bind\", \"127.0.0.1\", \"--directory\", \"" << dir.path().string()
                     << "\"]\nhealth = { http = \"/\", port = " << port
                     << " }\nmax_restarts = 2\nbackoff_seconds = 0.1\nready_timeout_seconds = 30\n"
                        "[group.train]\nkind = \"training\"\ncommand = [\""
                     << kProbe
                     << "\", \"--probe.steps=60\", \"--probe.step_ms=100\"]\nprocs_per_node = "
                        "2\nmax_restarts = 1\nafter = [\"web\"]\n";
  Launch l{util::Subprocess::spawn(
               {.argv = {kLoom, "run", "--run-dir", (dir / "run").string(), "--job", job.string()},
                .output = dir / "job.out"}),
           dir / "job.out"};
  const auto first = wait_probes(dir, 1, 2, std::chrono::seconds(30));
  ASSERT_EQ(first.size(), 2u) << l.text();
  for (const json& p : first) {
    EXPECT_EQ(p["services"], "LOOM_SERVICE_WEB=127.0.0.1:" + std::to_string(port)) << p;
  }
  const json web = wait_service(dir, "web", [](const json& e) { return e["state"] == "running"; });
  const int pid = web["pid"].get<int>();
  ASSERT_GT(pid, 0);
  ::kill(pid, SIGKILL);
  const json restarted = wait_service(dir, "web", [&](const json& e) {
    return e["restarts"] == 1 && e["state"] == "running" && e["pid"] != pid;
  });
  EXPECT_EQ(restarted["last_exit"], "killed by signal 9 (Killed)");
  EXPECT_TRUE(wait_probes(dir, 2, 1, std::chrono::seconds(0)).empty())
      << "the service's restart restarted training";
  // A worker killed: training restarts (generation 2); the service keeps its pid.
  ::kill(first[0]["pid"].get<int>(), SIGKILL);
  const auto second = wait_probes(dir, 2, 2, std::chrono::seconds(30));
  ASSERT_EQ(second.size(), 2u) << l.text();
  const json after = wait_service(dir, "web", [](const json&) { return true; });
  EXPECT_EQ(after["pid"], restarted["pid"]);
  EXPECT_EQ(after["restarts"], 1);
  ASSERT_EQ(finish(l, std::chrono::seconds(60)), 0) << l.text();
  const json stopped =
      wait_service(dir, "web", [](const json& e) { return e["state"] != "running"; });
  EXPECT_EQ(stopped["state"], "stopped") << stopped;
  const std::string log = util::read_file(dir / "run" / "logs" / "web_0.out");
  EXPECT_TRUE(testing::contains(log, "---- start 1 ----")) << log;
  EXPECT_TRUE(testing::contains(log, "---- start 2 ----")) << log;
  EXPECT_TRUE(testing::contains(l.text(), "[loom run] service web/0 ready")) << l.text();
}

// Two replicas of a service on one node listen on the health check's port + their index
// ({port}); the workers find both through rt.service() and LOOM_SERVICE_WEB. A generation-scoped
// service is stopped and started again when training restarts (a new pid, a second start in its
// log), while the job-scoped one keeps its pids; services_node0.json shows each one's scope.
TEST_F(Launcher, GenerationServicesRestartWithTrainingAndReplicasGetTheirOwnPorts) {
  TempDir dir;
  const int port = free_port();
  const std::string p0 = std::to_string(port), p1 = std::to_string(port + 1);
  const fs::path job = dir / "job.toml";
  std::ofstream(job) << "[group.web]\ncommand = [\"python3\", \"-m\", \"http.server\", \"{port}\", "
                        "\"--bind\", \"127.0.0.1\", \"--directory\", \""
                     << dir.path().string() << "\"]\nplacement = \"spread\"\nreplicas = 2\n"
                     << "health = { tcp = " << port << " }\nready_timeout_seconds = 30\n"
                     << "[group.gen]\ncommand = [\"sleep\", \"600\"]\nscope = \"generation\"\n"
                        "[group.train]\nkind = \"training\"\ncommand = [\""
                     << kProbe
                     << "\", \"--probe.steps=40\", \"--probe.step_ms=100\", "
                        "\"--probe.service=web\"]\nprocs_per_node = 2\nmax_restarts = 1\n"
                        "after = [\"web\", \"gen\"]\n";
  Launch l{util::Subprocess::spawn(
               {.argv = {kLoom, "run", "--run-dir", (dir / "run").string(), "--job", job.string()},
                .output = dir / "job.out"}),
           dir / "job.out"};
  const auto first = wait_probes(dir, 1, 2, std::chrono::seconds(30));
  ASSERT_EQ(first.size(), 2u) << l.text();
  for (const json& p : first) {
    EXPECT_EQ(p["services"],
              "LOOM_SERVICE_GEN=127.0.0.1;LOOM_SERVICE_WEB=127.0.0.1:" + p0 + ",127.0.0.1:" + p1)
        << p;
    EXPECT_EQ(p["service"], "127.0.0.1:" + p0 + ",127.0.0.1:" + p1) << p;
  }
  const json gen = wait_service(dir, "gen", [](const json& e) { return e["state"] == "running"; });
  EXPECT_EQ(gen["scope"], "generation");
  const fs::path state = dir / "run" / "services_node0.json";
  std::vector<int> web_pids;
  for (const json& e : json::parse(util::read_file(state))) {
    if (e["service"] != "web") continue;
    EXPECT_EQ(e["scope"], "job");
    EXPECT_EQ(e["endpoint"], "127.0.0.1:" + std::to_string(port + e["replica"].get<int>()));
    web_pids.push_back(e["pid"]);
  }
  ASSERT_EQ(web_pids.size(), 2u);
  // A worker killed: training restarts, and the generation's service with it.
  ::kill(first[0]["pid"].get<int>(), SIGKILL);
  const auto second = wait_probes(dir, 2, 2, std::chrono::seconds(30));
  ASSERT_EQ(second.size(), 2u) << l.text();
  const json regen = wait_service(
      dir, "gen", [&](const json& e) { return e["state"] == "running" && e["pid"] != gen["pid"]; });
  EXPECT_EQ(regen["starts"], 2);
  EXPECT_EQ(regen["restarts"], 0) << "a training restart is not the service's failure";
  EXPECT_EQ(::kill(gen["pid"].get<int>(), 0), -1) << "the old generation's service was stopped";
  std::vector<int> web_after;
  for (const json& e : json::parse(util::read_file(state))) {
    if (e["service"] == "web") web_after.push_back(e["pid"]);
  }
  EXPECT_EQ(web_after, web_pids) << "job-scoped services keep their processes";
  ASSERT_EQ(finish(l, std::chrono::seconds(60)), 0) << l.text();
  EXPECT_EQ(util::read_file(dir / "run" / "logs" / "gen_0.out"),
            "---- start 1 ----\n---- start 2 ----\n");
  for (const json& e : json::parse(util::read_file(state))) EXPECT_EQ(e["state"], "stopped") << e;
}

// A long-lived service: one `loom service start` began is attached to by name (published, not
// restarted, not stopped); one not running is started through the same registry and left
// running after the job, for the next job to attach to.
TEST_F(Launcher, ALongLivedServiceIsAttachedOrStartedAndOutlivesTheJob) {
  TempDir dir;
  const fs::path services = dir / "services";
  struct KillAtExit {
    fs::path dir;
    ~KillAtExit() {
      if (!fs::exists(dir)) return;
      for (const auto& f : fs::directory_iterator(dir)) {
        if (f.path().extension() == ".json")
          ::kill(-json::parse(util::read_file(f.path()))["pid"].get<int>(), SIGKILL);
      }
    }
  } cleanup{services};
  const int port = free_port(), fresh_port = free_port();
  const std::string p = std::to_string(port), q = std::to_string(fresh_port);
  auto run =
      testing::run_loom(dir, {"service", "start", "cache", "--dir", services.string(), "--port", p,
                              "--", "python3", "-m", "http.server", p, "--bind", "127.0.0.1"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const int cache_pid = json::parse(util::read_file(services / "cache.json"))["pid"];
  const fs::path job = dir / "job.toml";
  const auto server = [&](const std::string& name, int at) {
    return "[group." + name +
           "]\ncommand = [\"python3\", \"-m\", \"http.server\", \"{port}\", \"--bind\", "
           "\"127.0.0.1\"]\nscope = \"long-lived\"\nhealth = { tcp = " +
           std::to_string(at) + " }\n";
  };
  std::ofstream(job) << server("cache", port) << server("fresh", fresh_port)
                     << "[group.train]\nkind = \"training\"\ncommand = [\"" << kProbe
                     << "\", \"--probe.service=cache\"]\nafter = [\"cache\", \"fresh\"]\n";
  Launch l{util::Subprocess::spawn(
               {.argv = {kLoom, "run", "--run-dir", (dir / "run").string(), "--job", job.string()},
                .env = {{"LOOM_SERVICES_DIR", services.string()}},
                .output = dir / "job.out"}),
           dir / "job.out"};
  ASSERT_EQ(finish(l, std::chrono::seconds(60)), 0) << l.text();
  const auto probes = wait_probes(dir, 1, 1, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 1u) << l.text();
  EXPECT_EQ(probes[0]["service"], "127.0.0.1:" + p);
  const int fresh_pid = json::parse(util::read_file(services / "fresh.json"))["pid"];
  const std::string out = l.text();
  EXPECT_TRUE(testing::contains(out,
                                "[loom run] service cache/0 attached: long-lived cache runs "
                                "already (pid " +
                                    std::to_string(cache_pid) + ", tcp port " + p + ")\n"))
      << out;
  EXPECT_TRUE(testing::contains(out, "[loom run] service fresh/0 ready (pid " +
                                         std::to_string(fresh_pid) + ", tcp port " + q +
                                         "; long-lived: it outlives the job)\n"))
      << out;
  EXPECT_TRUE(testing::contains(
      out, "[loom run] service fresh/0 is long-lived: left running (pid " +
               std::to_string(fresh_pid) + "; `loom service stop fresh` stops it)\n"))
      << out;
  for (const json& e : json::parse(util::read_file(dir / "run" / "services_node0.json"))) {
    EXPECT_EQ(e["scope"], "long-lived");
    EXPECT_EQ(e["state"], "left-running");
    EXPECT_EQ(e["attached"], e["service"] == "cache") << e;
  }
  // Both still run after the job, listed by `loom service ls`; stopping them is the user's.
  run = testing::run_loom(dir, {"service", "ls", "--json", "--dir", services.string()});
  const json listed = json::parse(run.output);
  ASSERT_EQ(listed.size(), 2u) << run.output;
  EXPECT_EQ(listed[0]["pid"], cache_pid);
  EXPECT_EQ(listed[0]["state"], "alive");
  EXPECT_EQ(listed[1]["pid"], fresh_pid);
  EXPECT_EQ(listed[1]["state"], "alive");
  EXPECT_EQ(listed[1]["endpoint"], "127.0.0.1:" + q);
  for (const char* name : {"cache", "fresh"}) {
    run = testing::run_loom(dir, {"service", "stop", name, "--dir", services.string()});
    EXPECT_EQ(run.exit_code, 0) << run.output;
  }
}

// A job spec across two nodes (two agents on this host): a service spread over both, one
// replica each. Each node's workers get their own node's replica in LOOM_SERVICE_WEB, and
// rt.service() every node's, from the coordinator's store; the job's status lists both.
TEST_F(Launcher, AJobSpecAcrossTwoNodesFindsEveryNodesReplicas) {
  TempDir dir;
  const int port = free_port();
  const std::string p0 = std::to_string(port), p1 = std::to_string(port + 1);
  const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
  const fs::path job = dir / "job.toml";
  std::ofstream(job) << "[job]\nnodes = 2\n"
                        "[group.web]\ncommand = [\"python3\", \"-m\", \"http.server\", \"{port}\", "
                        "\"--bind\", \"127.0.0.1\", \"--directory\", \""
                     << dir.path().string() << "\"]\nplacement = \"spread\"\nreplicas = 2\n"
                     << "health = { tcp = " << port << " }\nready_timeout_seconds = 30\n"
                     << "[group.train]\nkind = \"training\"\ncommand = [\"" << kProbe
                     << "\", \"--probe.service=web\"]\nprocs_per_node = 1\nafter = [\"web\"]\n";
  std::vector<Launch> nodes;
  for (int node = 0; node < 2; ++node) {
    const std::string name = "node" + std::to_string(node);
    nodes.push_back(
        {util::Subprocess::spawn(
             {.argv = {kLoom, "run", "--run-dir", (dir / "run").string(), "--job", job.string(),
                       "--node-rank", std::to_string(node), "--coordinator", coordinator},
              .output = dir / (name + ".out")}),
         dir / (name + ".out")});
  }
  for (Launch& node : nodes) ASSERT_EQ(finish(node, std::chrono::seconds(60)), 0) << node.text();
  const auto probes = wait_probes(dir, 1, 2, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 2u);
  for (const json& p : probes) {
    const std::string own = p["rank"] == 0 ? p0 : p1;  // one worker per node: rank = node
    EXPECT_EQ(p["services"], "LOOM_SERVICE_WEB=127.0.0.1:" + own) << p;
    EXPECT_EQ(p["service"], "127.0.0.1:" + p0 + ",127.0.0.1:" + p1) << p;
  }
  for (int node = 0; node < 2; ++node) {
    const json state = json::parse(
        util::read_file(dir / "run" / ("services_node" + std::to_string(node) + ".json")));
    ASSERT_EQ(state.size(), 1u);
    EXPECT_EQ(state[0]["replica"], node);
    EXPECT_EQ(state[0]["node"], node);
    EXPECT_EQ(state[0]["state"], "stopped");
  }
  const json status = json::parse(util::read_file(dir / "run" / "job_metrics.json"));
  ASSERT_EQ(status["services"].size(), 2u) << status["services"];
  for (int node = 0; node < 2; ++node) EXPECT_EQ(status["services"][node]["node"], node);
}

TEST_F(Launcher, TwoAgentsTimesTwoWorkers) {
  TempDir dir;
  const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
  const auto start = Clock::now();
  Launch node0 = launch(
      dir, "node0",
      {"--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0", "--coordinator", coordinator},
      {});
  Launch node1 = launch(
      dir, "node1",
      {"--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--coordinator", coordinator},
      {});
  EXPECT_EQ(finish(node1), 0) << node1.text();
  EXPECT_EQ(finish(node0), 0) << node0.text();
  const auto probes = wait_probes(dir, 1, 4, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 4u) << node0.text() << node1.text();
  for (const json& p : probes) {
    EXPECT_EQ(p["world"], 4);
    EXPECT_EQ(p["sum"], 10.0);
  }
  std::printf("two agents x two workers: job done in %.2f s\n",
              std::chrono::duration<double>(Clock::now() - start).count());
}

TEST_F(Launcher, RendezvousOfEightWorkers) {
  TempDir dir;
  const int64_t start_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
  Launch job = launch(dir, "job", {"--nproc-per-node", "8"}, {"--run.threads=1"});
  ASSERT_EQ(finish(job, std::chrono::seconds(120)), 0) << job.text();
  const auto probes = wait_probes(dir, 1, 8, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 8u);
  int64_t last = 0;
  for (const json& p : probes) {
    EXPECT_EQ(p["sum"], 36.0);
    last = std::max<int64_t>(last, p["ready_ms"]);
  }
  std::printf(
      "rendezvous of 8 local workers: %lld ms from `loom run` to every rank's first all-reduce "
      "done\n",
      static_cast<long long>(last - start_ms));
}

TEST_F(Launcher, KilledWorkerRestartsTheGeneration) {
  TempDir dir;
  Launch job =
      launch(dir, "job", {"--nproc-per-node", "2", "--max-restarts", "2", "--grace-period", "2"},
             {"--probe.steps=30", "--probe.step_ms=100"});
  const auto gen1 = wait_probes(dir, 1, 2, std::chrono::seconds(60));
  ASSERT_EQ(gen1.size(), 2u) << job.text();
  const auto killed_at = Clock::now();
  ASSERT_EQ(::kill(gen1[1]["pid"].get<int>(), SIGKILL), 0);
  const auto gen2 = wait_probes(dir, 2, 2, std::chrono::seconds(60));
  ASSERT_EQ(gen2.size(), 2u) << job.text();
  const double latency = std::chrono::duration<double>(Clock::now() - killed_at).count();
  std::printf(
      "restart latency: %.2f s from SIGKILL of rank 1 to both ranks of generation 2 past their "
      "first all-reduce\n",
      latency);
  EXPECT_LT(latency, 30.0);
  for (const json& p : gen2) EXPECT_EQ(p["generation"], 2);
  EXPECT_EQ(finish(job), 0) << job.text();
  EXPECT_NE(job.text().find("rank 1 killed by signal 9"), std::string::npos) << job.text();
}

TEST_F(Launcher, FailuresBeyondMaxRestartsFailTheJobWithTheWorkersCode) {
  TempDir dir;
  Launch job =
      launch(dir, "job", {"--nproc-per-node", "2", "--max-restarts", "1"}, {"--probe.exit_code=7"});
  EXPECT_EQ(finish(job), 7) << job.text();
  EXPECT_EQ(wait_probes(dir, 2, 2, std::chrono::seconds(1)).size(), 2u) << "one restart happened";
}

TEST_F(Launcher, ElasticJobContinuesWhenANodeIsLost) {
  TempDir dir;
  const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
  const std::vector<std::string> common = {"--nnodes",      "1:2",       "--nproc-per-node", "2",
                                           "--coordinator", coordinator, "--node-timeout",   "2",
                                           "--last-call",   "1",         "--grace-period",   "2"};
  auto args = [&](int node) {
    auto a = common;
    a.insert(a.end(), {"--node-rank", std::to_string(node)});
    return a;
  };
  const std::vector<std::string> probe = {"--probe.steps=40", "--probe.step_ms=100"};
  Launch node0 = launch(dir, "node0", args(0), probe);
  Launch node1 = launch(dir, "node1", args(1), probe);
  const auto gen1 = wait_probes(dir, 1, 4, std::chrono::seconds(60));
  ASSERT_EQ(gen1.size(), 4u) << node0.text() << node1.text();
  for (const json& p : gen1) EXPECT_EQ(p["world"], 4);
  node1.process.signal(SIGKILL);  // the agent of node 1 dies; its workers are orphaned
  const auto gen2 = wait_probes(dir, 2, 2, std::chrono::seconds(60));
  ASSERT_EQ(gen2.size(), 2u) << node0.text();
  for (const json& p : gen2) {
    EXPECT_EQ(p["world"], 2);
    EXPECT_EQ(p["sum"], 3.0);
  }
  EXPECT_EQ(finish(node0), 0) << node0.text();
  EXPECT_NE(node0.text().find("lost"), std::string::npos) << node0.text();
}

// ---- unmodified PyTorch programs (torchrun's environment, rank 0 hosting the TCPStore) ----

const std::string kPython = "/usr/bin/python3";
const std::string kTorchDdp = LOOM_SOURCE_DIR "/tests/programs/torch_ddp.py";

bool python_has_torch() {
  return fs::exists(kPython) && testing::run_program({kPython, "-c", "import torch.distributed"},
                                                     fs::temp_directory_path())
                                        .exit_code == 0;
}

Launch launch_python(const TempDir& dir, const std::string& name, std::vector<std::string> args,
                     const std::vector<std::string>& script_args) {
  std::vector<std::string> argv = {kLoom, "run", "--run-dir", (dir / "run").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--", kPython, kTorchDdp, "--out", (dir / "ddp").string()});
  argv.insert(argv.end(), script_args.begin(), script_args.end());
  const fs::path output = dir / (name + ".out");
  return {util::Subprocess::spawn({.argv = argv, .output = output}), output};
}

// The records torch_ddp.py wrote for a generation (gen<g>_rank<r>.json), once `count` exist.
std::vector<json> wait_ddp(const TempDir& dir, int generation, int count,
                           std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::vector<json> found;
    for (int r = 0; r < 8; ++r) {
      const fs::path f =
          dir / "ddp" /
          ("gen" + std::to_string(generation) + "_rank" + std::to_string(r) + ".json");
      if (fs::exists(f)) found.push_back(json::parse(util::read_file(f)));
    }
    if (static_cast<int>(found.size()) >= count || Clock::now() > deadline) return found;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Every rank of a world of `world` all-reduced 0..4 + 10 * rank, trained to the same
// parameters (bit for bit: DDP all-reduces the gradients), and matches plain single-process
// training on the whole batch up to summation order.
void expect_ddp_world(const std::vector<json>& records, int world) {
  ASSERT_EQ(static_cast<int>(records.size()), world);
  for (const json& r : records) {
    EXPECT_EQ(r["world"], world);
    std::vector<double> expected;
    for (int i = 0; i < 5; ++i) expected.push_back(world * i + 10.0 * world * (world - 1) / 2);
    EXPECT_EQ(r["allreduce"].get<std::vector<double>>(), expected) << r.dump();
    EXPECT_EQ(r["params_hex"], records[0]["params_hex"]) << "rank " << r["rank"];
    EXPECT_LT(r["reference_max_abs_diff"].get<double>(), 1e-6) << r.dump();
  }
}

TEST_F(Launcher, UnmodifiedPyTorchDdpProgramTrainsTwoRanks) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch (apt install python3-torch)";
  TempDir dir;
  Launch job = launch_python(dir, "job", {"--nproc_per_node", "2", "--rdzv-id", "ddp-test"}, {});
  ASSERT_EQ(finish(job, std::chrono::seconds(120)), 0) << job.text();
  const auto records = wait_ddp(dir, 1, 2, std::chrono::seconds(1));
  expect_ddp_world(records, 2);
  for (const json& r : records) {
    const json& env = r["env"];
    const std::string rank = std::to_string(r["rank"].get<int>());
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], records[0]["env"]["MASTER_PORT"]);
    EXPECT_EQ(env["RANK"], rank);
    EXPECT_EQ(env["LOCAL_RANK"], rank);
    EXPECT_EQ(env["ROLE_RANK"], rank);
    for (const char* k : {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"})
      EXPECT_EQ(env[k], "2");
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "ddp-test");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "False");
    if (std::getenv("OMP_NUM_THREADS") == nullptr) {
      EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    }
  }
}

TEST_F(Launcher, PyTorchProgramWithAFailedRankRecoversUnderMaxRestarts) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch (apt install python3-torch)";
  TempDir dir;
  Launch job = launch_python(dir, "job", {"--nproc-per-node", "2", "--max_restarts", "1"},
                             {"--fail-rank", "1"});
  ASSERT_EQ(finish(job, std::chrono::seconds(180)), 0) << job.text();
  EXPECT_TRUE(wait_ddp(dir, 1, 1, std::chrono::seconds(0)).size() <= 1u)
      << "rank 1 failed in generation 1";
  EXPECT_FALSE(fs::exists(dir / "ddp" / "gen1_rank1.json"));
  const auto records = wait_ddp(dir, 2, 2, std::chrono::seconds(1));
  expect_ddp_world(records, 2);
  for (const json& r : records) {
    EXPECT_EQ(r["env"]["TORCHELASTIC_RESTART_COUNT"], "1");
    EXPECT_EQ(r["env"]["TORCHELASTIC_MAX_RESTARTS"], "1");
  }
  EXPECT_NE(job.text().find("[rank 1] rank 1: failing on purpose"), std::string::npos)
      << job.text();
  // Rank 0 then fails too (its peer closed the connection); the agent may see either first.
  EXPECT_NE(job.text().find("exited with code 1; restart 1 of 1"), std::string::npos) << job.text();
}

TEST_F(Launcher, ElasticPyTorchProgramContinuesWhenANodeIsLost) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch (apt install python3-torch)";
  TempDir dir;
  const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
  auto args = [&](int node) {
    return std::vector<std::string>{"--nnodes",         "1:2",
                                    "--nproc-per-node", "1",
                                    "--rdzv-endpoint",  coordinator,
                                    "--node-timeout",   "2",
                                    "--last-call",      "1",
                                    "--grace-period",   "2",
                                    "--node_rank",      std::to_string(node)};
  };
  const std::vector<std::string> slow = {"--steps", "60", "--step-seconds", "0.1"};
  Launch node0 = launch_python(dir, "node0", args(0), slow);
  Launch node1 = launch_python(dir, "node1", args(1), slow);
  const auto deadline = Clock::now() + std::chrono::seconds(90);
  while (!(fs::exists(dir / "ddp" / "started_gen1_rank0") &&
           fs::exists(dir / "ddp" / "started_gen1_rank1")) &&
         Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(fs::exists(dir / "ddp" / "started_gen1_rank1")) << node0.text() << node1.text();
  node1.process.signal(SIGKILL);  // node 1's agent dies; its worker loses its peers and exits
  const auto records = wait_ddp(dir, 2, 1, std::chrono::seconds(120));
  expect_ddp_world(records, 1);
  EXPECT_EQ(finish(node0, std::chrono::seconds(60)), 0) << node0.text();
  EXPECT_FALSE(fs::exists(dir / "ddp" / "gen1_rank0.json")) << "generation 1 did not finish";
  EXPECT_NE(node0.text().find("lost"), std::string::npos) << node0.text();
}

TEST_F(Launcher, WrongTokenIsRefused) {
  TempDir dir;
  const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
  const std::vector<std::string> common = {
      "--nnodes", "2", "--coordinator", coordinator, "--rendezvous-timeout", "20"};
  auto a0 = common;
  a0.insert(a0.end(), {"--node-rank", "0"});
  auto a1 = common;
  a1.insert(a1.end(), {"--node-rank", "1"});
  Launch node0 = launch(dir, "node0", a0, {}, {{"LOOM_JOB_TOKEN", "right-token"}});
  Launch intruder = launch(dir, "node1", a1, {}, {{"LOOM_JOB_TOKEN", "wrong-token"}});
  EXPECT_EQ(finish(intruder), 1) << intruder.text();
  EXPECT_NE(intruder.text().find("refused the job token"), std::string::npos) << intruder.text();
  node0.process.signal(SIGTERM);
  EXPECT_EQ(finish(node0), 128 + SIGTERM) << node0.text();
  EXPECT_NE(node0.text().find("refused Join"), std::string::npos) << node0.text();
}

using testing::NetworkNamespaces;

// `loom run` as node `node` of a two-node job inside namespace `node`, with `extra` options.
Launch launch_in_namespace(const NetworkNamespaces& net, int node, const TempDir& dir,
                           const std::string& name, const std::string& coordinator,
                           const std::vector<std::string>& extra,
                           const std::vector<std::string>& probe_args = {}) {
  std::vector<std::string> argv = {"ip",
                                   "netns",
                                   "exec",
                                   net.name(node),
                                   kLoom,
                                   "run",
                                   "--run-dir",
                                   (dir / "run").string(),
                                   "--nnodes",
                                   "2",
                                   "--nproc-per-node",
                                   "2",
                                   "--node-rank",
                                   std::to_string(node),
                                   "--coordinator",
                                   coordinator};
  if (node == 0) argv.push_back("--coordinator-public");
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--", kProbe});
  argv.insert(argv.end(), probe_args.begin(), probe_args.end());
  const fs::path output = dir / (name + ".out");
  return {util::Subprocess::spawn(
              {.argv = argv, .env = {{"LOOM_JOB_TOKEN", "netns-test-token"}}, .output = output}),
          output};
}

TEST_F(Launcher, NodesInSeparateNetworkNamespaces) {
  NetworkNamespaces net;
  if (!net.ok()) GTEST_SKIP() << "cannot create network namespaces (needs root and iproute2)";
  TempDir dir;
  const std::string coordinator = "10.231.0.1:" + std::to_string(free_port());
  std::vector<Launch> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(
        launch_in_namespace(net, node, dir, "node" + std::to_string(node), coordinator, {}));
  }
  EXPECT_EQ(finish(nodes[1]), 0) << nodes[1].text();
  EXPECT_EQ(finish(nodes[0]), 0) << nodes[0].text();
  const auto probes = wait_probes(dir, 1, 4, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 4u) << nodes[0].text() << nodes[1].text();
  for (const json& p : probes) {
    EXPECT_EQ(p["sum"], 10.0);
    // Two ranks per namespace: shared memory inside each "node", TCP between them.
    EXPECT_EQ(p["transport"], "hierarchical");
    // Four floats in [0, 1): three roundings, each at most 2^-24 of a partial sum below 4.
    EXPECT_LE(p["max_error"].get<double>(), 3 * 4 * std::ldexp(1.0, -24)) << p.dump();
  }
}

// --tls-* for a node certificate `c` of the job's CA.
std::vector<std::string> tls_args(const testing::TestCa::Issued& c, const fs::path& ca) {
  return {"--tls-cert", c.cert.string(), "--tls-key", c.key.string(), "--tls-ca", ca.string()};
}

// A job over mutual TLS across the namespaces, with certificates made here. While node 0
// waits for its peer, a plaintext agent and one whose certificate another CA signed try to
// join from node 1's namespace: both are refused (the job then runs with the real node 1 only,
// at world size 4). The workers reach the coordinator over TLS too (LOOM_TLS_*).
TEST_F(Launcher, NodesInSeparateNetworkNamespacesOverMutualTls) {
  if (!testing::have_openssl()) GTEST_SKIP() << "no openssl (tools/install-deps.sh)";
  NetworkNamespaces net;
  if (!net.ok()) GTEST_SKIP() << "cannot create network namespaces (needs root and iproute2)";
  TempDir dir;
  testing::TestCa ca(dir.path(), "job");
  const auto node0_cert = ca.issue("node0", {"10.231.0.1", "127.0.0.1"});
  const auto node1_cert = ca.issue("node1", {"10.231.0.2"});
  testing::TestCa other(dir.path(), "other");
  const auto intruder_cert = other.issue("intruder", {"10.231.0.2"});
  const std::string coordinator = "10.231.0.1:" + std::to_string(free_port());

  Launch node0 =
      launch_in_namespace(net, 0, dir, "node0", coordinator, tls_args(node0_cert, ca.cert()));
  Launch plaintext = launch_in_namespace(net, 1, dir, "plaintext", coordinator, {});
  Launch intruder =
      launch_in_namespace(net, 1, dir, "intruder", coordinator, tls_args(intruder_cert, ca.cert()));
  EXPECT_EQ(finish(plaintext), 1) << plaintext.text();
  EXPECT_NE(plaintext.text().find("error: the coordinator at " + coordinator +
                                  " did not answer Join within 11000 ms: is it running and "
                                  "reachable? If it uses TLS, this client needs --tls-ca too"),
            std::string::npos)
      << plaintext.text();
  EXPECT_EQ(finish(intruder), 1) << intruder.text();
  EXPECT_NE(intruder.text().find("did not answer Join within 11000 ms: is it running and "
                                 "reachable? With TLS, also check"),
            std::string::npos)
      << intruder.text();
  EXPECT_FALSE(node0.process.wait_for(std::chrono::milliseconds(0)).has_value())
      << "node 0 still waits for its peer: " << node0.text();

  Launch node1 =
      launch_in_namespace(net, 1, dir, "node1", coordinator, tls_args(node1_cert, ca.cert()));
  EXPECT_EQ(finish(node1), 0) << node1.text();
  EXPECT_EQ(finish(node0), 0) << node0.text();
  const auto probes = wait_probes(dir, 1, 4, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 4u) << node0.text() << node1.text();
  for (const json& p : probes) {
    EXPECT_EQ(p["world"], 4);
    EXPECT_EQ(p["sum"], 10.0);
  }
}

// The same on one machine (no privileges needed): two agents over mutual TLS on loopback.
TEST_F(Launcher, TwoAgentsOverMutualTlsOnLoopback) {
  if (!testing::have_openssl()) GTEST_SKIP() << "no openssl (tools/install-deps.sh)";
  TempDir dir;
  testing::TestCa ca(dir.path(), "job");
  const auto cert = ca.issue("node", {"127.0.0.1"});
  const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
  std::vector<Launch> nodes;
  for (int node = 0; node < 2; ++node) {
    auto args = tls_args(cert, ca.cert());
    args.insert(args.end(), {"--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                             std::to_string(node), "--coordinator", coordinator});
    nodes.push_back(launch(dir, "node" + std::to_string(node), args, {}));
  }
  EXPECT_EQ(finish(nodes[1]), 0) << nodes[1].text();
  EXPECT_EQ(finish(nodes[0]), 0) << nodes[0].text();
  const auto probes = wait_probes(dir, 1, 2, std::chrono::seconds(1));
  ASSERT_EQ(probes.size(), 2u) << nodes[0].text() << nodes[1].text();
  for (const json& p : probes) EXPECT_EQ(p["sum"], 3.0);
}

TEST_F(Launcher, TlsOptionsAreCheckedAndFilesNamed) {
  TempDir dir;
  auto r = testing::run_loom(dir, {"run", "--tls-cert", "node.pem", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("error: TLS needs all of --tls-cert, --tls-key and --tls-ca on every "
                          "node; missing: --tls-key --tls-ca\n"),
            std::string::npos)
      << r.output;
  const fs::path missing = dir / "absent.pem";
  r = testing::run_loom(dir, {"run", "--tls-cert", missing.string(), "--tls-key", "k.pem",
                              "--tls-ca", "ca.pem", "--", kProbe});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: cannot read the TLS certificate (--tls-cert) \"" +
                          missing.string() + "\": No such file or directory\n"),
            std::string::npos)
      << r.output;
}

// A worker fails just after the coordinator went away (the worker itself SIGKILLs node 0's
// agent, which hosts it): reporting the failure fails. The agent must say so and exit 1 when
// its next heartbeat finds the coordinator gone, stopping its workers, not std::terminate
// (SIGABRT, 134) with its output thread still running. A heartbeat in flight at the kill, or
// one that lands before the agent has seen its worker exit (more likely on a loaded machine),
// takes the "lost the coordinator" path without the report: also exit 1, but not the path
// under test, so the test tries up to three times to get the report path.
TEST_F(Launcher, AFailureTheCoordinatorCannotHearEndsTheAgentCleanly) {
  bool reported = false;
  for (int attempt = 0; attempt < 3 && !reported; ++attempt) {
    TempDir dir;
    const std::string coordinator = "127.0.0.1:" + std::to_string(free_port());
    auto args = [&](int node) {
      return std::vector<std::string>{
          "--nnodes",      "2",         "--nproc-per-node", "1",
          "--coordinator", coordinator, "--node-rank",      std::to_string(node)};
    };
    Launch node0 = launch(dir, "node0", args(0), {});
    Launch node1 =
        launch(dir, "node1", args(1),
               {"--probe.kill_pid=" + std::to_string(node0.process.pid()), "--probe.exit_code=7"});
    EXPECT_EQ(finish(node0), 128 + SIGKILL) << node0.text();
    EXPECT_EQ(finish(node1), 1) << node1.text();  // either path: never 134
    const std::string out = node1.text();
    EXPECT_NE(out.find("[loom run] lost the coordinator: "), std::string::npos) << out;
    // The call fails as a broken connection or, reconnecting, as no answer in time.
    const std::string said = "[loom run] could not report the failure to the coordinator: ";
    const auto at = out.find(said);
    if (at == std::string::npos) continue;  // the heartbeat found the coordinator gone first
    reported = true;
    EXPECT_NE(out.find("[loom run] rank 1 exited with code 7\n"), std::string::npos) << out;
    const std::string line = out.substr(at, out.find('\n', at) - at);
    EXPECT_NE(line.find(coordinator), std::string::npos) << line;
    EXPECT_NE(line.find("ReportFailure"), std::string::npos) << line;
  }
  EXPECT_TRUE(reported) << "three attempts, and the heartbeat found the coordinator gone first "
                           "each time: the report path was never taken";
}

TEST_F(Launcher, BadArgumentsAreClearErrors) {
  TempDir dir;
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {kLoom, "run"});
    return testing::run_program(args, dir.path());
  };
  auto r = run({"--nproc-per-node", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("program"), std::string::npos) << r.output;
  r = run({"--nnodes", "3:2", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("MIN:MAX"), std::string::npos) << r.output;
  r = run({"--nnodes", "2", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--coordinator"), std::string::npos) << r.output;
  r = run({"--coordinator", "0.0.0.0:0", "--node-rank", "0", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--coordinator-public"), std::string::npos) << r.output;
  // Zero workers is not a job that "succeeds" by running nothing (issue 23), nor are
  // negative or absurd counts.
  for (const char* n : {"0", "-1", "4097", "two"}) {
    r = run({"--nproc-per-node", n, "--", kProbe});
    EXPECT_EQ(r.exit_code, 2) << n << ": " << r.output;
    EXPECT_NE(r.output.find("--nproc-per-node"), std::string::npos) << n << ": " << r.output;
    EXPECT_EQ(r.output.find("the job is done"), std::string::npos) << n << ": " << r.output;
  }
  // Slurm's environment is input too: a malformed count names its variable.
  auto slurm =
      testing::run_program({"/usr/bin/env", "SLURM_JOB_ID=1", "SLURM_NODEID=0", "SLURM_NNODES=1",
                            "SLURM_NTASKS_PER_NODE=lots", kLoom, "run", "--", kProbe},
                           dir.path());
  EXPECT_EQ(slurm.exit_code, 2) << slurm.output;
  EXPECT_NE(slurm.output.find("$SLURM_NTASKS_PER_NODE is 'lots'"), std::string::npos)
      << slurm.output;
  r = run({"--standalone", "--nnodes", "2", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--standalone"), std::string::npos) << r.output;
  // The job metrics' options (docs/observability.md), each named.
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--straggler-threshold", "1"},
                                                        {"--straggler-threshold", "0.5"},
                                                        {"--straggler-window", "0"},
                                                        {"--straggler-window", "3601"},
                                                        {"--hang-factor", "-1"},
                                                        {"--hang-min-seconds", "-5"}}) {
    r = run({flag, value, "--", kProbe});
    EXPECT_EQ(r.exit_code, 2) << flag << " " << value << ": " << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag << " " << value << ": " << r.output;
  }
  r = run({"--metrics-address", "9400", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the metrics address must be host:port"), std::string::npos) << r.output;
  r = run({"--metrics-address", "0.0.0.0:0", "--", kProbe});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("needs --coordinator-public"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace loom
