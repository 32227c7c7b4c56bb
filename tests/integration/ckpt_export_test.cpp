// `loom ckpt export|import` against Debian's PyTorch (/usr/bin/python3): a checkpoint saved by two
// ranks with ZeRO-style flat pieces exports whole in both formats and Python reads every tensor
// bit for bit; a state_dict saved by torch.save, and a safetensors file written by Python,
// import as committed checkpoints whose weights load bit for bit and give Python's output;
// malformed safetensors files are CorruptData naming the file.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/ckpt/export.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::contains;
using testing::run_loom;
using testing::TempDir;

const std::string kPython = "/usr/bin/python3";
const std::string kTensorFiles = LOOM_SOURCE_DIR "/tests/programs/tensor_files.py";

bool python_has_torch() {
  return fs::exists(kPython) &&
         testing::run_program({kPython, "-c", "import torch"}, fs::temp_directory_path())
                 .exit_code == 0;
}

std::string hex(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (int64_t i = 0; i < c.numel() * c.element_size(); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

std::string code(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      return "?";
  }
}

json python(const TempDir& dir, const std::string& command, const fs::path& file) {
  const fs::path out = dir / (command + ".json");
  auto r = testing::run_program({kPython, kTensorFiles, command, file.string(), out.string()},
                                dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? json::parse(util::read_file(out)) : json{};
}

// A checkpoint as DataParallel with ZeRO at world size 2 writes one: "model/..." replicated
// (written by rank 0), "optim/..." in flat pieces split between the ranks, the per-rank RNG in
// rows; every dtype safetensors names. Returns the full tensors, by saved name.
std::map<std::string, at::Tensor> make_zero_checkpoint(const fs::path& ckpt_dir, int64_t step) {
  torch::manual_seed(3);
  std::map<std::string, at::Tensor> full = {
      {"model/embed.weight", torch::randn({10, 4})},
      {"model/out.bias", torch::randn({7}).to(at::kBFloat16)},
      {"model/half", torch::randn({5}).to(at::kHalf)},
      {"model/f64", torch::randn({2, 2}, at::kDouble)},
      {"model/count", torch::tensor({int64_t{5}, -(int64_t{1} << 40)})},
      {"model/i32", torch::tensor({1, -2, 3}, at::kInt)},
      {"model/i16", torch::tensor({-300, 300}, at::kShort)},
      {"model/i8", torch::tensor({-7, 7}, at::kChar)},
      {"model/u8", torch::tensor({0, 255}, at::kByte)},
      {"model/mask", torch::rand({3, 3}) > 0.5},
      {"optim/embed.weight/exp_avg", torch::randn({10, 4})},
      {"rng/cpu", torch::randint(0, 255, {2, 8}, at::kByte)},
  };
  comm::InMemoryStore store;
  auto rank = [&](int r) {
    ckpt::Checkpointer ckpt(store, {.dir = ckpt_dir, .rank = r, .world_size = 2});
    ckpt::State s;
    for (const auto& [name, t] : full) {
      if (name.rfind("model/", 0) == 0) {
        s.add(name, t);
      } else if (name == "rng/cpu") {
        s.add(name, t.narrow(0, r, 1).contiguous(), ckpt::Sharding::rows({2, 8}, r, r + 1));
      } else {  // elements [0, 17) on rank 0, [17, 40) on rank 1
        const int64_t b = r == 0 ? 0 : 17, e = r == 0 ? 17 : 40;
        s.add(name, t.reshape({-1}).narrow(0, b, e - b).contiguous(),
              ckpt::Sharding::flat({10, 4}, b, e));
      }
    }
    s.blobs["optim"] = R"({"optimizer":"adamw","step":3,"zero_stage":1})";
    ckpt.save_sync(step, s);
  };
  std::thread r1([&] { rank(1); });
  rank(0);
  r1.join();
  return full;
}

// Every expected tensor is in `dumped` (Python's view) with its dtype, shape and bytes.
void expect_same_tensors(const std::map<std::string, at::Tensor>& expected, const json& dumped) {
  ASSERT_EQ(dumped.size(), expected.size()) << dumped.dump();
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(dumped.contains(name)) << name << " missing from " << dumped.dump();
    const json& d = dumped.at(name);
    EXPECT_EQ(d["dtype"], code(t.scalar_type())) << name;
    EXPECT_EQ(d["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
    EXPECT_EQ(d["hex"], hex(t)) << name;
  }
}

class CkptExport : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch (apt install python3-torch)";
  }
};

TEST_F(CkptExport, ZeroCheckpointExportsWholeAndPythonReadsEveryTensorBitwise) {
  TempDir dir;
  const auto full = make_zero_checkpoint(dir / "ckpt", 5);
  std::map<std::string, at::Tensor> model, with_optim;
  for (const auto& [name, t] : full) {
    if (name.rfind("model/", 0) == 0) model[name.substr(6)] = t;
  }
  with_optim = model;
  with_optim["optim/embed.weight/exp_avg"] = full.at("optim/embed.weight/exp_avg");

  auto run = run_loom(dir, {"ckpt", "export", (dir / "ckpt").string(), "5",
                            (dir / "m.safetensors").string(), "--format", "safetensors"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "step 5: 10 tensors")) << run.output;
  const json st = python(dir, "dump-safetensors", dir / "m.safetensors");
  expect_same_tensors(model, st["tensors"]);
  EXPECT_EQ(st["metadata"]["loom.step"], "5");
  EXPECT_EQ(st["metadata"]["format"], "pt");

  run = run_loom(dir, {"ckpt", "export", (dir / "ckpt").string(), "latest", (dir / "m.pt").string(),
                       "--format", "torch", "--optimizer"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json pt = python(dir, "dump-torch", dir / "m.pt");
  expect_same_tensors(with_optim, pt["tensors"]);

  // And back: the exported safetensors file imports to the same tensors.
  run = run_loom(dir, {"ckpt", "import", (dir / "m.safetensors").string(), (dir / "back").string(),
                       "--format", "safetensors", "--step", "9"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto back = ckpt::read_model_tensors(dir / "back", 9, {});
  ASSERT_EQ(back.size(), model.size());
  for (const auto& t : back) EXPECT_EQ(hex(t.tensor), hex(model.at(t.name))) << t.name;
}

// Python's torch.save of a module's state_dict() (and a safetensors file Python wrote) becomes
// a committed checkpoint; its weights load into the same libtorch module bit for bit, and the
// module's output on Python's input is Python's output, bit for bit (the same kernels).
void expect_import_matches_python(const std::string& save_command, const std::string& format) {
  TempDir dir;
  const fs::path file = dir / ("weights." + format);
  const json saved = python(dir, save_command, file);
  ASSERT_TRUE(saved.contains("tensors"));
  auto run = run_loom(dir, {"ckpt", "import", file.string(), (dir / "ckpt").string(), "--format",
                            format, "--step", "7"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "11 tensors imported as step 7")) << run.output;
  EXPECT_EQ(run_loom(dir, {"ckpt", "verify", (dir / "ckpt").string(), "7"}).exit_code, 0);

  torch::nn::Sequential model(torch::nn::Linear(4, 3),
                              torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
  std::vector<ckpt::NamedTensor> params;
  for (const auto& p : model->named_parameters()) params.push_back({p.key(), p.value()});
  std::map<std::string, at::Tensor> extras = {{"extra.bf16", torch::empty({5}, at::kBFloat16)},
                                              {"extra.f16", torch::empty({2, 3}, at::kHalf)},
                                              {"extra.i64", torch::empty({3}, at::kLong)},
                                              {"extra.i32", torch::empty({2}, at::kInt)},
                                              {"extra.u8", torch::empty({3}, at::kByte)},
                                              {"extra.mask", torch::empty({2, 2}, at::kBool)},
                                              {"extra.f64", torch::empty({1}, at::kDouble)}};
  for (const auto& [name, t] : extras) params.push_back({name, t});
  EXPECT_EQ(ckpt::load_model_weights(dir / "ckpt", ckpt::Checkpointer::kLatest, params), 7);
  std::map<std::string, at::Tensor> loaded;
  for (const auto& p : params) loaded[p.name] = p.tensor.detach();
  expect_same_tensors(loaded, saved["tensors"]);

  torch::NoGradGuard no_grad;
  const at::Tensor x = torch::arange(8, at::kFloat).reshape({2, 4}) / 10;
  EXPECT_EQ(hex(x), saved["input_hex"]);
  EXPECT_EQ(hex(model->forward(x)), saved["output_hex"]);

  // Strict about the model: a parameter the checkpoint lacks is named.
  params.push_back({"2.weight", torch::empty({3})});
  const std::string error = testing::error_of<InvalidArgument>(
      [&] { ckpt::load_model_weights(dir / "ckpt", 7, params); });
  EXPECT_TRUE(contains(error, "2.weight")) << error;
}

TEST_F(CkptExport, TorchSaveStateDictImports) {
  expect_import_matches_python("save-torch", "torch");
}

TEST_F(CkptExport, PythonSafetensorsImports) {
  expect_import_matches_python("save-safetensors", "safetensors");
}

// The loss of every step rank 0 logged to <run_dir>/metrics.jsonl.
std::vector<double> logged_losses(const fs::path& run_dir) {
  std::vector<double> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    if (j.contains("loss") && j.contains("step")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// The GPT example end to end: the checkpoint of a short run exports in both formats and Python
// reads every model tensor bit for bit; Python's torch.save of that state_dict imports, and a
// run started from it (train.init_from) takes its first step with exactly the loss of a run
// started from the original checkpoint, which is not a fresh start's loss.
TEST_F(CkptExport, GptExampleCheckpointGoesToPythonAndBack) {
  const std::string gpt = LOOM_BINARY_DIR "/examples/gpt";
  if (!fs::exists(gpt)) GTEST_SKIP() << gpt << " not built (LOOM_BUILD_EXAMPLES=OFF)";
  TempDir dir;
  const fs::path text = dir / "genesis.txt";
  ASSERT_TRUE(
      util::Subprocess::spawn({.argv = {"bible", "gen1:1-gen10:32"}, .output = text}).wait().ok());
  const std::string ds = (dir / "kjv").string();
  auto built = run_loom(
      dir, {"data", "build", "text", "--input", text.string(), "--vocab-size", "300", "--out", ds});
  ASSERT_EQ(built.exit_code, 0) << built.output;
  auto train = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {gpt,
                                     "--data.train=" + ds,
                                     "--data.val=" + ds,
                                     "--model.n_layer=1",
                                     "--model.n_head=2",
                                     "--model.n_embd=16",
                                     "--model.seq_len=16",
                                     "--train.batch_size=4",
                                     "--eval.batches=1",
                                     "--sample.tokens=2",
                                     "--train.log_every=1",
                                     "--run.dir=" + (dir / name).string()};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return testing::run_program(argv, dir.path());
  };
  auto first = train("first", {"--train.steps=2", "--train.checkpoint_every=2"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path ckpt_dir = dir / "first" / "ckpt";

  std::map<std::string, at::Tensor> model;
  for (const auto& t : ckpt::read_model_tensors(ckpt_dir, 2, {})) model[t.name] = t.tensor;
  ASSERT_GT(model.size(), 4u);  // embeddings, a block's weights, the final norm
  auto run = run_loom(dir, {"ckpt", "export", ckpt_dir.string(), "2",
                            (dir / "gpt.safetensors").string(), "--format", "safetensors"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  expect_same_tensors(model, python(dir, "dump-safetensors", dir / "gpt.safetensors")["tensors"]);
  run = run_loom(dir, {"ckpt", "export", ckpt_dir.string(), "2", (dir / "gpt.pt").string(),
                       "--format", "torch"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  expect_same_tensors(model, python(dir, "dump-torch", dir / "gpt.pt")["tensors"]);

  // Python saves the state_dict it loaded; Loom imports that file and trains from it.
  expect_same_tensors(model, python(dir, "resave-torch", dir / "gpt.pt")["tensors"]);
  run = run_loom(dir, {"ckpt", "import", (dir / "gpt.pt.python.pt").string(),
                       (dir / "imported").string(), "--format", "torch"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto from_original =
      train("original", {"--train.steps=1", "--train.init_from=" + ckpt_dir.string()});
  ASSERT_EQ(from_original.exit_code, 0) << from_original.output;
  auto from_python =
      train("python", {"--train.steps=1", "--train.init_from=" + (dir / "imported").string()});
  ASSERT_EQ(from_python.exit_code, 0) << from_python.output;
  const auto fresh = logged_losses(dir / "first");
  const auto original = logged_losses(dir / "original");
  const auto python_loss = logged_losses(dir / "python");
  ASSERT_EQ(fresh.size(), 2u);
  ASSERT_EQ(original.size(), 1u);
  ASSERT_EQ(python_loss.size(), 1u);
  EXPECT_EQ(python_loss[0], original[0]);  // bitwise: the same weights, data and kernels
  EXPECT_NE(python_loss[0], fresh[0]);     // not a fresh start
}

// ---- bad input: CorruptData naming the file, exit 1, nothing committed ----

// Files shaped like torch.save's that lie (a storage record shorter than its elements, a view
// past its storage, a missing record), call something other than the tensor builders (the
// pickle of os.system is refused, never run), or hold something else than a dict of tensors.
TEST_F(CkptExport, HostileTorchFilesAreCorruptDataNamingTheFile) {
  TempDir dir;
  const json made = python(dir, "save-hostile-torch", dir.path());
  ASSERT_EQ(made["expected"].size(), 7u) << made.dump();
  for (const auto& [name, words] : made["expected"].items()) {
    const fs::path file = dir / name;
    auto run = run_loom(
        dir, {"ckpt", "import", file.string(), (dir / "ckpt").string(), "--format", "torch"});
    EXPECT_EQ(run.exit_code, 1) << name << ": " << run.output;
    EXPECT_TRUE(contains(run.output, "CORRUPT: torch file " + file.string())) << run.output;
    EXPECT_TRUE(contains(run.output, words.get<std::string>())) << name << ": " << run.output;
    EXPECT_FALSE(contains(run.output, "pwned")) << run.output;
  }
  EXPECT_FALSE(fs::exists(dir / "ckpt" / "step_00000000"));
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string length_prefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

std::string safetensors_with(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

TEST(CkptImport, MalformedSafetensorsAreCorruptDataNamingTheFile) {
  TempDir dir;
  const std::string f32x2 = std::string(8, '\1');
  const std::string good =
      safetensors_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2);
  const std::map<std::string, std::pair<std::string, std::string>> cases = {
      {"short", {"\x10\0\0", "shorter than the 8-byte header length"}},
      {"truncated", {good.substr(0, good.size() - 3), "outside the data section"}},
      {"huge_header",
       {length_prefix(uint64_t{1} << 60) + "{}", "the header length says 1152921504606846976"}},
      {"offsets_outside",
       {safetensors_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", f32x2),
        "data_offsets [8, 16] lie outside"}},
      {"unknown_dtype",
       {safetensors_with(R"({"w":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})", f32x2),
        "unknown dtype \"F8_E4M3\""}},
      {"shape_mismatch",
       {safetensors_with(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
        "needs 3 elements"}},
      {"not_json", {safetensors_with("{not json", f32x2), "not a JSON object"}},
  };
  for (const auto& [name, c] : cases) {
    const fs::path file = dir / (name + ".safetensors");
    write_bytes(file, c.first);
    auto run = run_loom(
        dir, {"ckpt", "import", file.string(), (dir / "ckpt").string(), "--format", "safetensors"});
    EXPECT_EQ(run.exit_code, 1) << name << ": " << run.output;
    EXPECT_TRUE(contains(run.output, "CORRUPT")) << name << ": " << run.output;
    EXPECT_TRUE(contains(run.output, file.string())) << name << ": " << run.output;
    EXPECT_TRUE(contains(run.output, c.second)) << name << ": " << run.output;
    EXPECT_FALSE(fs::exists(dir / "ckpt" / "step_00000000" / "manifest.json")) << name;
  }
  // The good one imports; a torch file that is not one is CorruptData too.
  write_bytes(dir / "good.safetensors", good);
  EXPECT_EQ(run_loom(dir, {"ckpt", "import", (dir / "good.safetensors").string(),
                           (dir / "ckpt").string(), "--format", "safetensors"})
                .exit_code,
            0);
  write_bytes(dir / "bad.pt", "PK\3\4 not a zip");
  auto run = run_loom(dir, {"ckpt", "import", (dir / "bad.pt").string(), (dir / "ckpt2").string(),
                            "--format", "torch"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output, (dir / "bad.pt").string())) << run.output;
  // Bad arguments: exit 2.
  run = run_loom(dir, {"ckpt", "import", (dir / "good.safetensors").string(),
                       (dir / "ckpt").string(), "--format", "onnx"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "use torch or safetensors")) << run.output;
  run = run_loom(dir, {"ckpt", "import", (dir / "good.safetensors").string(),
                       (dir / "ckpt").string(), "--format", "safetensors"});
  EXPECT_EQ(run.exit_code, 2) << "step 0 is committed already: " << run.output;
  run = run_loom(dir, {"ckpt", "export", (dir / "ckpt").string(), "12", (dir / "x.pt").string(),
                       "--format", "torch"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "not a committed checkpoint")) << run.output;
}

}  // namespace
}  // namespace loom
