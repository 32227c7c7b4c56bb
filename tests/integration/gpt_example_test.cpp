// The GPT example as a user runs it: parallel.mode from the command line (DDP, ZeRO-1, ZeRO-2
// train alike, bitwise at one rank), and the result is the held-out loss at the last step even
// when train.steps is not a multiple of train.eval_every.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::run_loom;
using testing::TempDir;

// As the example logs it: four decimals.
std::string fmt_loss(double loss) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4f", loss);
  return text;
}

class GptExample : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (LOOM_BUILD_EXAMPLES=OFF)";
    const fs::path text = dir_ / "genesis.txt";
    ASSERT_TRUE(util::Subprocess::spawn({.argv = {"bible", "gen1:1-gen10:32"}, .output = text})
                    .wait()
                    .ok());
    dataset_ = (dir_ / "kjv").string();
    const auto built = run_loom(dir_, {"data", "build", "text", "--input", text.string(),
                                       "--vocab-size", "300", "--out", dataset_});
    ASSERT_EQ(built.exit_code, 0) << built.output;
  }

  testing::ProgramResult train(const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {kGpt,
                                     "--data.train=" + dataset_,
                                     "--data.val=" + dataset_,
                                     "--model.n_layer=2",
                                     "--model.n_head=2",
                                     "--model.n_embd=16",
                                     "--model.seq_len=16",
                                     "--train.batch_size=4",
                                     "--train.steps=5",
                                     "--train.eval_every=2",
                                     "--eval.batches=1",
                                     "--sample.tokens=2",
                                     "--train.log_every=1",
                                     "--run.dir=" + (dir_ / name).string()};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return testing::run_program(argv, dir_.path());
  }

  // Every step's loss rank 0 logged, by step.
  std::map<int64_t, double> losses(const std::string& name) const {
    std::map<int64_t, double> out;
    std::ifstream in(dir_ / name / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line);
      if (j.contains("loss") && j.contains("step")) out[j["step"]] = j["loss"].get<double>();
    }
    return out;
  }

  json result(const std::string& name) const {
    std::ifstream in(dir_ / name / "result.json");
    return json::parse(in);
  }

  const std::string kGpt = LOOM_BINARY_DIR "/examples/gpt";
  TempDir dir_;
  std::string dataset_;
};

TEST_F(GptExample, EveryParallelModeTrainsTheSameAtOneRank) {
  const auto ddp = train("ddp", {});
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const auto reference = losses("ddp");
  ASSERT_EQ(reference.size(), 5u);
  for (const std::string mode : {"zero1", "zero2"}) {
    const auto run = train(mode, {"--parallel.mode=" + mode, "--parallel.bucket_mb=0.01"});
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(losses(mode), reference) << mode;  // bitwise: one rank, the same arithmetic
  }
  const auto bad = train("bad", {"--parallel.mode=zero3"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(testing::contains(bad.output, "parallel.mode is 'zero3'")) << bad.output;
}

TEST_F(GptExample, TheResultIsTheHeldOutLossAfterTheLastStep) {
  const auto run = train("run", {});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json curve = result("run")["curve"];
  std::vector<int64_t> steps;
  for (const json& point : curve) steps.push_back(point["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 2, 4, 5}));
  EXPECT_NE(curve.back()["val_loss"], curve.front()["val_loss"]);
  EXPECT_TRUE(testing::contains(
      run.output,
      "held-out loss " + fmt_loss(curve.back()["val_loss"].get<double>()) + " after steps 0..5"))
      << run.output;
}

}  // namespace
}  // namespace loom
