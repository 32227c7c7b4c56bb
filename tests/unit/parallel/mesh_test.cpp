// DeviceMesh with ranks as threads: row-major coordinates, each dimension's group holding
// exactly the ranks that differ only in it (checked by an all-gather of world ranks through
// it), the pp x dp x tp config, and bad shapes named with their numbers.

#include "loom/parallel/mesh.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "loom/runtime.h"

namespace loom::parallel {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using ::testing::HasSubstr;

std::unique_ptr<comm::Group> make_world(Rank& r) {
  comm::GlooOptions options;
  options.connect_timeout = std::chrono::seconds(20);
  return comm::new_gloo_group(r.store, r.rank, r.world, options);
}

Config config_of(const std::vector<std::string>& overrides) {
  ConfigSources sources;
  sources.read_env = false;
  sources.overrides = overrides;
  return Config::load(mesh_schema(), sources);
}

// The world ranks of `group`'s members, in group order, as its all-gather sees them.
std::vector<int64_t> members(comm::Group& group, int world_rank) {
  at::Tensor mine = torch::full({1}, world_rank, torch::kLong);
  at::Tensor all = torch::empty({group.size()}, torch::kLong);
  group.all_gather(all, mine)->wait(std::chrono::seconds(30));
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

TEST(DeviceMesh, ThreeDimensionsAreRowMajorAndEachGroupHoldsTheRanksThatDifferOnlyInIt) {
  // pp=2 x dp=2 x tp=2 over 8 ranks: world rank = 4 pp + 2 dp + tp.
  expect_all_ok(run_threads(8, [](Rank& r) {
    auto world = make_world(r);
    DeviceMesh mesh(*world, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
    const int pp = r.rank / 4, dp = (r.rank / 2) % 2, tp = r.rank % 2;
    EXPECT_EQ(mesh.coordinates(), (std::vector<int>{pp, dp, tp}));
    EXPECT_EQ(mesh.coordinate("pp"), pp);
    EXPECT_EQ(mesh.coordinate("dp"), dp);
    EXPECT_EQ(mesh.coordinate("tp"), tp);
    EXPECT_EQ(mesh.rank_at({pp, dp, tp}), r.rank);
    EXPECT_EQ(mesh.describe(), "pp=2 x dp=2 x tp=2");
    const int base = 4 * pp + 2 * dp;
    EXPECT_EQ(members(mesh.group("tp"), r.rank), (std::vector<int64_t>{base, base + 1}));
    EXPECT_EQ(members(mesh.group("dp"), r.rank),
              (std::vector<int64_t>{4 * pp + tp, 4 * pp + 2 + tp}));
    EXPECT_EQ(members(mesh.group("pp"), r.rank),
              (std::vector<int64_t>{2 * dp + tp, 4 + 2 * dp + tp}));
    for (const char* dim : {"pp", "dp", "tp"}) {
      EXPECT_EQ(mesh.size(dim), 2);
      EXPECT_EQ(mesh.group(dim).rank(), mesh.coordinate(dim)) << dim;
    }
  }));
}

TEST(DeviceMesh, UnevenSizesAndDimensionsOfOne) {
  // 6 ranks as dp=3 x tp=2, and as a mesh with a size-1 dimension in the middle.
  expect_all_ok(run_threads(6, [](Rank& r) {
    auto world = make_world(r);
    DeviceMesh mesh(*world, {{"dp", 3}, {"tp", 2}});
    EXPECT_EQ(members(mesh.group("dp"), r.rank),
              (std::vector<int64_t>{r.rank % 2, 2 + r.rank % 2, 4 + r.rank % 2}));
    EXPECT_EQ(members(mesh.group("tp"), r.rank),
              (std::vector<int64_t>{r.rank / 2 * 2, r.rank / 2 * 2 + 1}));
    DeviceMesh with_one(*world, {{"pp", 3}, {"dp", 1}, {"tp", 2}});
    EXPECT_EQ(with_one.size("dp"), 1);
    EXPECT_EQ(with_one.coordinate("dp"), 0);
    EXPECT_EQ(members(with_one.group("dp"), r.rank), (std::vector<int64_t>{r.rank}));
    EXPECT_EQ(members(with_one.group("tp"), r.rank),
              (std::vector<int64_t>{r.rank / 2 * 2, r.rank / 2 * 2 + 1}));
  }));
}

TEST(DeviceMesh, ConfigBuildsPipelineDataTensorAndDataTakesTheRest) {
  expect_all_ok(run_threads(4, [](Rank& r) {
    auto world = make_world(r);
    EXPECT_EQ(mesh_from(*world, config_of({"parallel.tp=2"}))->describe(), "pp=1 x dp=2 x tp=2");
    EXPECT_EQ(mesh_from(*world, config_of({"parallel.pp=2", "parallel.dp=1", "parallel.tp=2"}))
                  ->describe(),
              "pp=2 x dp=1 x tp=2");
  }));
}

TEST(DeviceMesh, TheRuntimeBuildsItFromItsConfigOnce) {
  testing::TempDir dir;
  expect_all_ok(run_threads(4, [&](Rank& r) {
    const Config config = Config::load(
        Runtime::schema(), {.read_env = false,
                            .overrides = {"run.dir=" + (dir / "run").string(), "run.device=cpu",
                                          "log.level=warn", "log.to_file=false", "parallel.tp=2"}});
    Runtime rt = Runtime::init(config, Topology{r.rank, r.world, r.rank, r.world},
                               /*configure_process=*/false, {.store = &r.store});
    DeviceMesh& mesh = rt.mesh();
    EXPECT_EQ(&rt.mesh(), &mesh);
    EXPECT_EQ(mesh.describe(), "pp=1 x dp=2 x tp=2");
    EXPECT_EQ(&mesh.world(), &rt.world_group());
    EXPECT_EQ(members(mesh.group("tp"), r.rank),
              (std::vector<int64_t>{r.rank / 2 * 2, r.rank / 2 * 2 + 1}));
  }));
}

TEST(DeviceMesh, BadShapesNameTheNumbers) {
  expect_all_ok(run_threads(4, [](Rank& r) {
    auto world = make_world(r);
    auto message = [&](std::vector<MeshDim> dims) {
      try {
        DeviceMesh mesh(*world, std::move(dims));
      } catch (const InvalidArgument& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_EQ(message({{"dp", 3}, {"tp", 2}}),
              "DeviceMesh dp=3 x tp=2 has 6 ranks but the world has 4; choose sizes whose "
              "product is 4");
    EXPECT_EQ(message({{"dp", 2}, {"dp", 2}}),
              "DeviceMesh dp=2 x dp=2: dimension 'dp' appears twice; give each dimension its own "
              "name");
    EXPECT_EQ(message({{"dp", 4}, {"tp", 0}}),
              "DeviceMesh dp=4 x tp=0: dimension 'tp' has size 0; every size must be at least 1");
    EXPECT_EQ(message({{"", 4}}),
              "DeviceMesh =4: a dimension has no name; name every dimension (e.g. \"dp\", "
              "\"tp\")");
    DeviceMesh mesh(*world, {{"dp", 2}, {"tp", 2}});
    EXPECT_THAT(
        [&] { mesh.group("pp"); },
        ::testing::ThrowsMessage<InvalidArgument>(
            "DeviceMesh dp=2 x tp=2 has no dimension 'pp'; use one of its dimension names"));
    EXPECT_THAT(
        [&] {
          mesh.rank_at({0, 2});
        },
        ::testing::ThrowsMessage<InvalidArgument>(
            "DeviceMesh dp=2 x tp=2: coordinate 2 of 'tp' is outside [0, 2)"));

    auto config_message = [&](std::vector<std::string> args) {
      try {
        mesh_from(*world, config_of(args));
      } catch (const ConfigError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_EQ(config_message({"parallel.tp=3"}),
              "parallel.pp = 1 times parallel.tp = 3 is 3, which does not divide the world size "
              "4; choose pp and tp whose product divides 4");
    EXPECT_EQ(config_message({"parallel.dp=3", "parallel.tp=2"}),
              "parallel.pp = 1 x parallel.dp = 3 x parallel.tp = 2 is 6 ranks but the world has "
              "4; choose sizes whose product is 4 (or parallel.dp = 0)");
    EXPECT_EQ(config_message({"parallel.pp=0"}),
              "parallel.pp is 0, parallel.tp is 1 and parallel.dp is 0; pp and tp must be at "
              "least 1 and dp at least 0 (0: the rest)");
  }));
}

}  // namespace
}  // namespace loom::parallel
