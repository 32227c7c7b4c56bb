// Every bundled GPT config loads through the example's keys (with Runtime's), as the program
// would load it, and GPT-2 124M has GPT-2 small's shape, bf16 and the H200 micro-batch.
#include "config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/error.h>
#include <loom/parallel/data_parallel.h>
#include <loom/parallel/fsdp.h>
#include <loom/parallel/strategy.h>
#include <loom/runtime.h>

#include <filesystem>
#include <string>
#include <vector>

namespace gpt {
namespace {

loom::Config load(const std::vector<std::string>& args) {
  loom::ConfigSchema schema = loom::Runtime::schema();
  schema.merge(config_schema());
  std::vector<const char*> argv = {"gpt"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return loom::Config::from_args(schema, static_cast<int>(argv.size()), argv.data());
}

const std::filesystem::path kConfigs = std::filesystem::path(GPT_SOURCE_DIR) / "configs";

TEST(GptConfigs, EveryBundledConfigLoadsWithCudaAsTheDevice) {
  int loaded = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kConfigs)) {
    if (entry.path().extension() != ".toml") continue;
    const loom::Config cfg = load({"--config=" + entry.path().string(), "--run.device=cuda"});
    EXPECT_EQ(cfg.get<std::string>("run.device"), "cuda") << entry.path();
    EXPECT_NO_THROW(parameter_dtype(cfg)) << entry.path();
    ++loaded;
  }
  EXPECT_GE(loaded, 3);  // tiny, small, gpt2-124m at least
}

TEST(GptConfigs, Gpt2SmallIsTwelveByTwelveByWide768InBf16) {
  const loom::Config cfg = load({"--config=" + (kConfigs / "gpt2-124m.toml").string()});
  EXPECT_EQ(cfg.get<int64_t>("model.n_layer"), 12);
  EXPECT_EQ(cfg.get<int64_t>("model.n_head"), 12);
  EXPECT_EQ(cfg.get<int64_t>("model.n_embd"), 768);
  EXPECT_EQ(cfg.get<int64_t>("model.seq_len"), 1024);
  EXPECT_EQ(parameter_dtype(cfg), c10::kBFloat16);
  // 512 sequences (llm.c's 0.5M tokens) per step in micro-batches of 64 on one H200.
  EXPECT_EQ(cfg.get<int64_t>("train.batch_size"), 512);
  EXPECT_EQ(cfg.get<int64_t>("train.batch_size") / cfg.get<int64_t>("train.micro_batches"), 64);
}

TEST(GptConfigs, AnUnknownDtypeIsAConfigErrorNamingTheKey) {
  const loom::Config cfg = load({"--model.dtype=float8"});
  try {
    parameter_dtype(cfg);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const loom::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.dtype"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parameter_dtype(load({})), c10::kFloat);
}

TEST(GptConfigs, ParallelModeChoosesTheStrategyAndBadModesNameTheKey) {
  using loom::parallel::DataParallelOptions;
  using loom::parallel::FsdpOptions;
  using loom::parallel::Mode;
  using loom::parallel::ZeroStage;
  EXPECT_EQ(loom::parallel::mode_from(load({})), Mode::kDdp);
  EXPECT_EQ(loom::parallel::mode_from(load({"--parallel.mode=fsdp"})), Mode::kFsdp);
  EXPECT_EQ(DataParallelOptions::from(load({})).zero_stage, ZeroStage::kNone);
  EXPECT_EQ(DataParallelOptions::from(load({"--parallel.mode=zero1"})).zero_stage, ZeroStage::kOne);
  const DataParallelOptions zero2 =
      DataParallelOptions::from(load({"--parallel.mode=zero2", "--parallel.bucket_mb=2"}));
  EXPECT_EQ(zero2.zero_stage, ZeroStage::kTwo);
  EXPECT_EQ(zero2.bucket_bytes, size_t{2} << 20);
  const FsdpOptions fsdp_default = FsdpOptions::from(load({"--parallel.mode=fsdp"}));
  EXPECT_TRUE(fsdp_default.reshard_after_forward);
  EXPECT_FALSE(fsdp_default.reduce_dtype.has_value());
  EXPECT_FALSE(fsdp_default.param_dtype.has_value());
  EXPECT_FALSE(fsdp_default.offload_optimizer_state);
  const FsdpOptions fsdp =
      FsdpOptions::from(load({"--parallel.mode=fsdp", "--parallel.reshard_after_forward=false",
                              "--parallel.reduce_dtype=fp32", "--parallel.param_dtype=bf16",
                              "--parallel.offload_optimizer_state=true"}));
  EXPECT_FALSE(fsdp.reshard_after_forward);
  EXPECT_TRUE(fsdp.offload_optimizer_state);
  EXPECT_EQ(fsdp.reduce_dtype, c10::kFloat);
  EXPECT_EQ(fsdp.param_dtype, c10::kBFloat16);
  struct Bad {
    std::vector<std::string> args;
    const char* key;
  };
  for (const Bad& bad : {Bad{{"--parallel.mode=zero4"}, "parallel.mode"},
                         Bad{{"--parallel.bucket_mb=0"}, "parallel.bucket_mb"},
                         Bad{{"--parallel.mode=fsdp"}, "parallel.mode"}}) {
    try {
      DataParallelOptions::from(load(bad.args));
      ADD_FAILURE() << bad.args[0] << ": expected a ConfigError";
    } catch (const loom::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(bad.key), std::string::npos) << e.what();
    }
  }
  try {
    FsdpOptions::from(load({"--parallel.reduce_dtype=fp16"}));
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const loom::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.reduce_dtype is 'fp16'"), std::string::npos)
        << e.what();
  }
  EXPECT_THAT([&] { FsdpOptions::from(load({"--parallel.param_dtype=fp16"})); },
              ::testing::ThrowsMessage<loom::ConfigError>(
                  "parallel.param_dtype is 'fp16'; use bf16, or leave it empty to compute in the "
                  "parameters' dtype"));
}

}  // namespace
}  // namespace gpt
