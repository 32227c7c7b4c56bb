// Job specs: every field of a full spec as parsed, the start order and each node's processes,
// the plan `loom run --job --check` prints, and each kind of bad spec as an error naming the
// file, the line and the key.
#include "loom/control/job_spec.h"

#include <gtest/gtest.h>

#include <fstream>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::control {
namespace {

using loom::testing::error_of;
using loom::testing::TempDir;

// The issue's job: 2 training workers per node, a 2-replica data service they wait for, a
// job-scoped evaluator on node 1, a per-node cache that outlives the job.
constexpr const char* kJob = R"([job]
nodes = 2

[group.cache]
command = ["loom", "data", "cache", "--dir", "/tmp/cache"]
scope = "long-lived"
restart = "always"
health = { http = "/healthz", port = 9100 }

[group.data]
command = ["loom", "data", "service", "--port", "7000"]
placement = "spread"
replicas = 3
max_restarts = 5
backoff_seconds = 0.5
health = { tcp = 7000 }
ready_timeout_seconds = 30
after = ["cache"]
env = { OMP_NUM_THREADS = "1" }
cpus = [0, 1]

[group.train]
kind = "training"
command = ["build/examples/gpt", "--config=examples/gpt/configs/tiny.toml"]
procs_per_node = 2
max_restarts = 2
after = ["data"]

[group.eval]
command = ["python3", "eval.py"]
placement = "node:1"
restart = "never"
health = { heartbeat = true }
)";

class JobSpecs : public ::testing::Test {
 protected:
  std::filesystem::path write(const std::string& text) {
    const auto path = dir_ / "job.toml";
    std::ofstream(path) << text;
    return path;
  }
  // The ConfigError a spec gives.
  std::string error(const std::string& text) {
    const auto path = write(text);
    return error_of<ConfigError>([&] { parse_job_spec(path); });
  }
  TempDir dir_;
};

TEST_F(JobSpecs, EveryFieldOfAFullSpecIsRead) {
  const auto path = write(kJob);
  const JobSpec spec = parse_job_spec(path);
  EXPECT_EQ(spec.nodes, 2);
  ASSERT_EQ(spec.groups.size(), 4u);
  const GroupSpec& cache = spec.groups[0];
  EXPECT_EQ(cache.name, "cache");
  EXPECT_FALSE(cache.training);
  EXPECT_EQ(cache.command,
            (std::vector<std::string>{"loom", "data", "cache", "--dir", "/tmp/cache"}));
  EXPECT_EQ(cache.placement.kind, Placement::Kind::kEveryNode);
  EXPECT_EQ(cache.restart, RestartPolicy::kAlways);
  EXPECT_EQ(cache.scope, Scope::kLongLived);
  EXPECT_EQ(cache.health.kind, Health::Kind::kHttp);
  EXPECT_EQ(cache.health.port, 9100);
  EXPECT_EQ(cache.health.path, "/healthz");
  EXPECT_EQ(cache.line, 4);
  const GroupSpec& data = spec.groups[1];
  EXPECT_EQ(data.name, "data");
  EXPECT_EQ(data.placement.kind, Placement::Kind::kSpread);
  EXPECT_EQ(data.placement.replicas, 3);
  EXPECT_EQ(data.restart, RestartPolicy::kOnFailure);
  EXPECT_EQ(data.max_restarts, 5);
  EXPECT_EQ(data.backoff_seconds, 0.5);
  EXPECT_EQ(data.scope, Scope::kJob);
  EXPECT_EQ(data.health.kind, Health::Kind::kTcp);
  EXPECT_EQ(data.health.port, 7000);
  EXPECT_EQ(data.ready_timeout_seconds, 30);
  EXPECT_EQ(data.after, (std::vector<std::string>{"cache"}));
  EXPECT_EQ(data.env, (std::map<std::string, std::string>{{"OMP_NUM_THREADS", "1"}}));
  EXPECT_EQ(data.cpus, (std::vector<int>{0, 1}));
  const GroupSpec& train = spec.training();
  EXPECT_EQ(train.name, "train");
  EXPECT_TRUE(train.training);
  EXPECT_EQ(train.procs_per_node, 2);
  EXPECT_EQ(train.max_restarts, 2);
  EXPECT_EQ(train.scope, Scope::kGeneration);
  EXPECT_EQ(train.health.kind, Health::Kind::kNone);
  const GroupSpec& eval = *spec.find("eval");
  EXPECT_EQ(eval.placement.kind, Placement::Kind::kNode);
  EXPECT_EQ(eval.placement.node, 1);
  EXPECT_EQ(eval.restart, RestartPolicy::kNever);
  EXPECT_EQ(eval.health.kind, Health::Kind::kHeartbeat);
  EXPECT_EQ(spec.find("nope"), nullptr);

  // cache, then data (after cache), then train (after data); eval waits for nothing but comes
  // later in the file than cache, so it starts once the earlier ones are placed.
  EXPECT_EQ(spec.start_order(), (std::vector<std::string>{"cache", "data", "train", "eval"}));
  using Procs = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ(spec.processes_on(0),
            (Procs{{"cache", 0}, {"data", 0}, {"data", 2}, {"train", 0}, {"train", 1}}));
  EXPECT_EQ(spec.processes_on(1),
            (Procs{{"cache", 1}, {"data", 1}, {"train", 0}, {"train", 1}, {"eval", 0}}));
  EXPECT_EQ(describe_plan(spec),
            path.string() +
                ": 4 group(s) on 2 node(s); start order: cache data train eval\n"
                "  cache: loom data cache --dir /tmp/cache\n"
                "    every node, restart always (at most 3, backoff 1 s), scope long-lived, "
                "health http :9100-9101/healthz\n"
                "  data: loom data service --port 7000\n"
                "    3 replica(s) spread, restart on-failure (at most 5, backoff 0.5 s), scope "
                "job, health tcp port 7000-7002, after cache\n"
                "  train (training): build/examples/gpt --config=examples/gpt/configs/tiny.toml\n"
                "    2 per node, restart on-failure (at most 2, backoff 1 s), scope generation, "
                "health none (ready once started), after data\n"
                "  eval: python3 eval.py\n"
                "    node 1, restart never (at most 3, backoff 1 s), scope job, health "
                "heartbeats through the store\n"
                "  node 0: cache/0 data/0 data/2 train/0 train/1\n"
                "  node 1: cache/1 data/1 train/0 train/1 eval/0\n");
}

// Replica r listens on the health check's port + r: "{port}" and "{replica}" in the command and
// the env are that replica's; other braces are the program's.
TEST_F(JobSpecs, EachReplicaGetsItsOwnPort) {
  const auto path = write(
      "[group.train]\nkind = \"training\"\ncommand = [\"prog\"]\n"
      "[group.web]\ncommand = [\"serve\", \"--port={port}\", \"--id\", \"{replica}\", \"{x}\"]\n"
      "placement = \"spread\"\nreplicas = 3\nhealth = { tcp = 7000 }\n"
      "env = { URL = \"http://127.0.0.1:{port}/{replica}\", PLAIN = \"1\" }\n"
      "[group.eval]\ncommand = [\"eval\", \"{replica}\"]\n");
  const JobSpec spec = parse_job_spec(path);
  const GroupSpec& web = *spec.find("web");
  EXPECT_EQ(web.replica_count(spec.nodes), 3);
  EXPECT_EQ(web.port_of(0), 7000);
  EXPECT_EQ(web.port_of(2), 7002);
  EXPECT_EQ(web.command_of(2),
            (std::vector<std::string>{"serve", "--port=7002", "--id", "2", "{x}"}));
  EXPECT_EQ(web.env_of(1), (std::map<std::string, std::string>{
                               {"PLAIN", "1"}, {"URL", "http://127.0.0.1:7001/1"}}));
  EXPECT_EQ(web.registry_name(0), "web");
  EXPECT_EQ(web.registry_name(2), "web@2");
  const GroupSpec& eval = *spec.find("eval");
  EXPECT_EQ(eval.port_of(0), 0);  // no health port
  EXPECT_EQ(eval.command_of(0), (std::vector<std::string>{"eval", "0"}));
}

TEST_F(JobSpecs, TheExampleJobsAreValid) {
  int found = 0;
  for (const auto& entry : std::filesystem::directory_iterator(LOOM_SOURCE_DIR "/examples/jobs")) {
    if (entry.path().extension() != ".toml") continue;
    const JobSpec spec = parse_job_spec(entry.path());
    EXPECT_EQ(spec.training().name, "train") << entry.path();
    ++found;
  }
  EXPECT_EQ(found, 3);
}

TEST_F(JobSpecs, BadSpecsNameTheFileTheLineAndTheKey) {
  const std::string file = (dir_ / "job.toml").string();
  const std::string train = "[group.train]\nkind = \"training\"\ncommand = [\"prog\"]\n";
  EXPECT_EQ(error("[group.train\n"),
            file + ":1:13: Error while parsing table header: expected ']', saw '\\n'");
  EXPECT_EQ(error(train + "replica = 2\n"),
            file +
                ":4: group.train.replica: unknown key; the keys here are kind, command, "
                "procs_per_node, replicas, placement, restart, max_restarts, "
                "backoff_seconds, scope, health, ready_timeout_seconds, after, env and cpus");
  EXPECT_EQ(error(train + "[group.data]\ncommand = [\"d\"]\nrestart = \"sometimes\"\n"),
            file +
                ":6: group.data.restart: is \"sometimes\"; use one of always, on-failure, "
                "never");
  EXPECT_EQ(error(train + "[group.data]\ncommand = [\"d\"]\nplacement = \"node:2\"\n"),
            file +
                ":4: group.data.placement: node:2 cannot be met: the job has 1 node(s), "
                "numbered from 0 (job.nodes)");
  EXPECT_EQ(error(train + "after = [\"data\"]\n"),
            file + ":1: group.train.after: no group named \"data\" in the job");
  EXPECT_EQ(error(train + "after = [\"a\"]\n[group.a]\ncommand = [\"a\"]\nafter = [\"b\"]\n"
                          "[group.b]\ncommand = [\"b\"]\nafter = [\"a\"]\n"),
            file +
                ": the start order has a cycle: a -> b -> a; remove one of those `after` "
                "entries");
  EXPECT_EQ(error("[group.data]\ncommand = [\"d\"]\n"),
            file +
                ": 0 training groups (none); a job has exactly one group with kind = "
                "\"training\"");
  EXPECT_EQ(error(train + "[group.again]\nkind = \"training\"\ncommand = [\"p\"]\n"),
            file +
                ": 2 training groups (train, again); a job has exactly one group with kind "
                "= \"training\"");
  EXPECT_EQ(error("[group.train]\nkind = \"training\"\n"),
            file +
                ":1: group.train.command: missing; give the program and its arguments as an "
                "array of strings");
  EXPECT_EQ(
      error(train + "[group.data]\ncommand = [\"d\"]\nhealth = { tcp = 1, heartbeat = true }\n"),
      file + ":6: group.data.health: needs exactly one of tcp, http and heartbeat");
  EXPECT_EQ(error(train + "[group.data]\ncommand = [\"d\"]\nhealth = { tcp = 70000 }\n"),
            file + ":6: group.data.health.tcp: is 70000; it must be in [1, 65535]");
  EXPECT_EQ(error(train + "[group.data]\ncommand = [\"d\"]\nafter = [\"train\"]\n"),
            file +
                ":1: group.train: the training group cannot be waited for (services start "
                "before it)");
  EXPECT_EQ(error(train + "[group.data]\ncommand = [\"d\", \"{port}\"]\n"),
            file +
                ":4: group.data: {port} needs a health check with a port (health = { tcp = "
                "PORT } or { http = \"/path\", port = PORT }): replica r gets PORT + r");
  EXPECT_EQ(error(train + "[group.data]\ncommand = [\"d\"]\nplacement = \"spread\"\n"
                          "replicas = 3\nhealth = { tcp = 65534 }\n"),
            file +
                ":4: group.data.health: replica 2 would listen on port 65536 (the health "
                "check's port + the replica's index), beyond 65535; lower the port");
  EXPECT_EQ(error(train + "[group.name]\ncommand = [\"d\"]\n"),
            file +
                ":4: group.name: the name is taken: a service gets its own name and replica as "
                "LOOM_SERVICE_NAME; rename the group");
  EXPECT_EQ(error(train + "[group.data-set]\ncommand = [\"d\"]\n[group.data_set]\ncommand = "
                          "[\"d\"]\n"),
            file +
                ":6: group.data_set: groups data-set and data_set would both be found as "
                "LOOM_SERVICE_DATA_SET; rename one of them");
  EXPECT_EQ(error("[jobs]\nnodes = 2\n"),
            file + ":1: jobs: unknown key; the keys here are job and group");
  EXPECT_EQ(error_of<ConfigError>([&] { parse_job_spec(dir_ / "missing.toml"); }),
            "job spec '" + (dir_ / "missing.toml").string() + "' not found");
}

}  // namespace
}  // namespace loom::control
