// Runtime: topology from env (Loom and torchrun names), run directory, config dump, seeds.
#include "loom/runtime.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>

#include "harness/harness.h"
#include "loom/comm/group.h"
#include "loom/comm/store.h"
#include "util/files.h"

namespace loom {
namespace {

// Sets environment variables for one test and restores the previous values afterwards.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      if (value) {
        ::setenv(name, value, 1);
      } else {
        ::unsetenv(name);
      }
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

const std::initializer_list<std::pair<const char*, const char*>> kNoTopologyEnv = {
    {"LOOM_RANK", nullptr},
    {"RANK", nullptr},
    {"LOOM_WORLD_SIZE", nullptr},
    {"WORLD_SIZE", nullptr},
    {"LOOM_LOCAL_RANK", nullptr},
    {"LOCAL_RANK", nullptr},
    {"LOOM_LOCAL_WORLD_SIZE", nullptr},
    {"LOCAL_WORLD_SIZE", nullptr},
    {"LOOM_COORDINATOR", nullptr},
    {"MASTER_ADDR", nullptr},
    {"MASTER_PORT", nullptr}};

TEST(Topology, DefaultsToOneProcess) {
  ScopedEnv env(kNoTopologyEnv);
  Topology t = Topology::from_env();
  EXPECT_EQ(t.rank, 0);
  EXPECT_EQ(t.world_size, 1);
  EXPECT_EQ(t.local_rank, 0);
  EXPECT_EQ(t.coordinator, "");
}

TEST(Topology, ReadsTorchrunNames) {
  ScopedEnv clear(kNoTopologyEnv);
  ScopedEnv env({{"RANK", "3"},
                 {"WORLD_SIZE", "4"},
                 {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "2"},
                 {"MASTER_ADDR", "10.1.2.3"},
                 {"MASTER_PORT", "29500"}});
  Topology t = Topology::from_env();
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.world_size, 4);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.local_world_size, 2);
  EXPECT_EQ(t.coordinator, "10.1.2.3:29500");
}

TEST(Topology, LoomNamesWinOverTorchrunNames) {
  ScopedEnv clear(kNoTopologyEnv);
  ScopedEnv env({{"RANK", "3"},
                 {"WORLD_SIZE", "4"},
                 {"LOOM_RANK", "1"},
                 {"LOOM_WORLD_SIZE", "2"},
                 {"LOOM_COORDINATOR", "node0:7000"},
                 {"MASTER_ADDR", "x"},
                 {"MASTER_PORT", "1"}});
  Topology t = Topology::from_env();
  EXPECT_EQ(t.rank, 1);
  EXPECT_EQ(t.world_size, 2);
  EXPECT_EQ(t.coordinator, "node0:7000");
}

TEST(Topology, BadValuesNameTheVariable) {
  ScopedEnv clear(kNoTopologyEnv);
  {
    ScopedEnv env({{"LOOM_RANK", "two"}});
    EXPECT_THROW(
        {
          try {
            Topology::from_env();
          } catch (const InvalidArgument& e) {
            EXPECT_NE(std::string(e.what()).find("LOOM_RANK='two'"), std::string::npos);
            throw;
          }
        },
        InvalidArgument);
  }
  {
    ScopedEnv env({{"LOOM_RANK", "4"}, {"LOOM_WORLD_SIZE", "4"}});
    EXPECT_THROW(Topology::from_env(), InvalidArgument);
  }
  {
    ScopedEnv env({{"MASTER_ADDR", "host"}});
    EXPECT_THROW(Topology::from_env(), InvalidArgument);
  }
  // Out of range: beyond long, beyond the 2^24 bound, negative.
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"LOOM_WORLD_SIZE", "99999999999999999999"},
                                                        {"WORLD_SIZE", "16777217"},
                                                        {"LOOM_GENERATION", "-1"},
                                                        {"LOCAL_RANK", "1\n"}}) {
    ScopedEnv env({{name.c_str(), value.c_str()}});
    try {
      Topology::from_env();
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(name + "='"), std::string::npos) << e.what();
    }
  }
}

Config config_in(const testing::TempDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"prog", "--run.dir=" + (dir / "run").string(),
                                   "--log.level=warn"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return Config::from_args(Runtime::schema(), static_cast<int>(argv.size()), argv.data());
}

TEST(Runtime, CreatesRunDirWithResolvedConfigAndLog) {
  testing::TempDir dir;
  Runtime rt = Runtime::init(config_in(dir, {"--run.seed=77"}), Topology{});
  EXPECT_TRUE(std::filesystem::is_directory(rt.run_dir()));
  EXPECT_EQ(rt.run_dir(), dir / "run");
  std::string saved = util::read_file(rt.run_dir() / "config.toml");
  EXPECT_NE(saved.find("seed = 77"), std::string::npos) << saved;
  rt.log().warn("a line for the file");
  rt.log().flush();
  std::string log = util::read_file(rt.run_dir() / "logs" / "rank_0.log");
  EXPECT_NE(log.find("[rank 0/1]"), std::string::npos) << log;
  EXPECT_NE(log.find("a line for the file"), std::string::npos) << log;
}

// A run directory or log file that cannot be made is IoError naming it and what to do, not
// std::filesystem's or spdlog's exception.
TEST(Runtime, AnUncreatableRunDirOrLogFileIsAnIoErrorNamingIt) {
  testing::TempDir dir;
  const auto file = dir / "a-file";
  std::ofstream(file) << "not a directory";
  EXPECT_EQ(testing::error_of<IoError>([&] {
              Runtime::init(config_in(dir, {"--run.dir=" + (file / "run").string()}), Topology{},
                            /*configure_process=*/false);
            }),
            "cannot create the run directory " + (file / "run").string() +
                ": Not a directory; set run.dir to a directory this process can create and write");
  // The log file's place taken by a directory.
  std::filesystem::create_directories(dir / "run" / "logs" / "rank_0.log");
  const std::string message = testing::error_of<IoError>(
      [&] { Runtime::init(config_in(dir, {"--log.level=info"}), Topology{}, false); });
  const std::string log = (dir / "run" / "logs" / "rank_0.log").string();
  EXPECT_EQ(message.rfind("cannot open the log file " + log + ": ", 0), 0u) << message;
  const std::string remedy = "; make it writable or set log.to_file = false";
  ASSERT_GT(message.size(), remedy.size()) << message;
  EXPECT_EQ(message.substr(message.size() - remedy.size()), remedy) << message;
}

TEST(Runtime, SeedsTorchDeterministically) {
  testing::TempDir dir;
  Runtime first = Runtime::init(config_in(dir, {"--run.seed=5"}), Topology{});
  torch::Tensor a = torch::randn({8});
  Runtime second = Runtime::init(config_in(dir, {"--run.seed=5"}), Topology{});
  torch::Tensor b = torch::randn({8});
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_EQ(first.seed(), 5u);
}

TEST(Runtime, RankSeedsDifferPerRank) {
  testing::TempDir dir;
  Topology t0{0, 2, 0, 2, ""};
  Topology t1{1, 2, 1, 2, ""};
  Runtime r0 = Runtime::init(config_in(dir), t0, /*configure_process=*/false);
  Runtime r1 = Runtime::init(config_in(dir), t1, /*configure_process=*/false);
  EXPECT_EQ(r0.seed(), r1.seed());
  EXPECT_NE(r0.rank_seed(), r1.rank_seed());
}

TEST(Runtime, ThreadsAndDevice) {
  testing::TempDir dir;
  Runtime rt = Runtime::init(config_in(dir, {"--run.threads=1", "--run.device=cpu"}), Topology{});
  EXPECT_EQ(rt.threads(), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_TRUE(rt.device().is_cpu());
  EXPECT_THROW(Runtime::init(config_in(dir, {"--run.device=tpu"}), Topology{}), ConfigError);
}

TEST(Runtime, InvalidTopologyIsRejected) {
  testing::TempDir dir;
  EXPECT_THROW(Runtime::init(config_in(dir), Topology{2, 2, 0, 1, ""}), InvalidArgument);
}

// Not under `loom run`: a service's endpoints come from LOOM_SERVICE_<NAME>, read once by
// Topology::from_env (a service's own LOOM_SERVICE_NAME and _REPLICA are not services).
TEST(Runtime, ServicesFromTheEnvironment) {
  ScopedEnv env({{"LOOM_SERVICE_DATA_CACHE", "10.0.0.1:7000,10.0.0.2:7001"},
                 {"LOOM_SERVICE_NAME", "me"},
                 {"LOOM_SERVICE_REPLICA", "0"}});
  const Topology t = Topology::from_env();
  EXPECT_EQ(t.services.count("LOOM_SERVICE_NAME"), 0u);
  EXPECT_EQ(t.services.at("LOOM_SERVICE_DATA_CACHE"), "10.0.0.1:7000,10.0.0.2:7001");
  testing::TempDir dir;
  Topology one;
  one.services = {{"LOOM_SERVICE_DATA_CACHE", "10.0.0.1:7000,10.0.0.2:7001"}};
  Runtime rt = Runtime::init(config_in(dir), one, /*configure_process=*/false);
  EXPECT_EQ(rt.service("data-cache"), (std::vector<std::string>{"10.0.0.1:7000", "10.0.0.2:7001"}));
  EXPECT_EQ(testing::error_of<InvalidArgument>([&] { rt.service("eval"); }),
            "no service named 'eval': LOOM_SERVICE_EVAL is not set (not under `loom run`; the "
            "LOOM_SERVICE_* variables set: LOOM_SERVICE_DATA_CACHE)");
}

// Under `loom run` (here: an attached in-memory store as the coordinator's) the endpoints are
// the store's, every replica in order; an unknown name fails at once naming the job's services,
// a replica never published fails at the deadline naming it.
TEST(Runtime, ServicesFromTheStore) {
  testing::TempDir dir;
  comm::InMemoryStore store;
  store.set("services", "data,eval");
  store.set("services/data/replicas", "2");
  store.set("services/data/1", "10.0.0.2:7001");
  store.set("services/data/0", "10.0.0.1:7000");
  store.set("services/eval/replicas", "2");
  store.set("services/eval/0", "10.0.0.1:9000");
  Runtime rt = Runtime::init(config_in(dir), Topology{}, /*configure_process=*/false,
                             Runtime::Attachments{.store = &store});
  EXPECT_EQ(rt.service("data"), (std::vector<std::string>{"10.0.0.1:7000", "10.0.0.2:7001"}));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(testing::error_of<InvalidArgument>([&] { rt.service("cache"); }),
            "no service named 'cache' in the job; its services: data, eval");
  EXPECT_EQ(testing::error_of<Timeout>([&] { rt.service("eval", std::chrono::milliseconds(200)); }),
            "service 'eval': replica(s) 1 of 2 not ready within 200 ms (see "
            "<run-dir>/services_node<N>.json and its logs)");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  store.set("services", "");
  EXPECT_EQ(testing::error_of<InvalidArgument>([&] { rt.service("data"); }),
            "no service named 'data' in the job; its services: none (start it with `loom run "
            "--job FILE`)");
}

}  // namespace
}  // namespace loom
