// Export of committed steps as torch or safetensors files, import of such files as committed
// steps, and loading a model's weights from one (see loom/ckpt/export.h).
#include "loom/ckpt/export.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/manifest.h"
#include "ckpt/reader.h"
#include "ckpt/safetensors.h"
#include "ckpt/storage.h"
#include "ckpt/torch_file.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "loom/error.h"

namespace loom::ckpt {
namespace {

namespace fs = std::filesystem;

constexpr const char* kModelPrefix = "model/";
constexpr const char* kOptimPrefix = "optim/";

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

fs::path committed_step_dir(const fs::path& ckpt_dir, int64_t step) {
  if (step < 0) {
    const auto steps = committed_steps(ckpt_dir);
    LOOM_CHECK(!steps.empty(), InvalidArgument, "no committed checkpoint in ", ckpt_dir.string());
    step = steps.back();
  }
  const fs::path dir = ckpt_dir / step_dir_name(step);
  LOOM_CHECK(fs::exists(dir / kManifestName), InvalidArgument, "step ", step,
             " is not a committed checkpoint in ", ckpt_dir.string(), " (no ",
             (dir / kManifestName).string(), ")");
  return dir;
}

}  // namespace

TensorFileFormat parse_tensor_file_format(const std::string& name) {
  if (name == "torch") return TensorFileFormat::kTorch;
  LOOM_CHECK(name == "safetensors", InvalidArgument, "unknown tensor file format \"", name,
             "\": use torch or safetensors");
  return TensorFileFormat::kSafetensors;
}

std::vector<NamedTensor> read_model_tensors(const fs::path& ckpt_dir, int64_t step,
                                            const ReadModelOptions& options) {
  const fs::path dir = committed_step_dir(ckpt_dir, step);
  StepReader reader(posix_storage(), dir, read_manifest(dir));
  bool has_model = false;
  for (const TensorRecord& r : reader.manifest().tensors)
    has_model = has_model || starts_with(r.name, kModelPrefix);
  std::vector<NamedTensor> tensors;
  for (const TensorRecord& r : reader.manifest().tensors) {
    std::string name = r.name;
    if (has_model && starts_with(name, kModelPrefix)) {
      name = name.substr(std::string(kModelPrefix).size());
    } else if (has_model && !(options.optimizer && starts_with(name, kOptimPrefix))) {
      continue;
    }
    at::Tensor t = at::empty(r.shape, at::TensorOptions().dtype(parse_dtype(r.dtype)));
    reader.read(r, 0, r.numel(), static_cast<char*>(t.data_ptr()), options.verify);
    tensors.push_back({std::move(name), std::move(t)});
  }
  return tensors;
}

void write_tensor_file(const fs::path& path, TensorFileFormat format,
                       const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  if (format == TensorFileFormat::kTorch) {
    write_torch_file(path, tensors);
  } else {
    write_safetensors(path, tensors, metadata);
  }
}

std::vector<NamedTensor> read_tensor_file(const fs::path& path, TensorFileFormat format) {
  LOOM_CHECK(fs::is_regular_file(path), IoError, "no file ", path.string());
  return format == TensorFileFormat::kTorch ? read_torch_file(path) : read_safetensors(path);
}

std::vector<NamedTensor> import_tensor_file(const fs::path& in, const fs::path& ckpt_dir,
                                            const ImportOptions& options) {
  std::vector<NamedTensor> tensors = read_tensor_file(in, options.format);
  State state;
  for (const NamedTensor& t : tensors) {
    state.add(starts_with(t.name, kOptimPrefix) ? t.name : kModelPrefix + t.name, t.tensor);
  }
  state.blobs["imported"] = nlohmann::json{
      {"source", fs::absolute(in).string()},
      {"format",
       options.format == TensorFileFormat::kTorch
           ? "torch"
           : "safetensors"}}.dump();
  comm::InMemoryStore store;
  Checkpointer checkpointer(store, {.dir = ckpt_dir});
  checkpointer.save_sync(options.step, state);
  return tensors;
}

int64_t load_model_weights(const fs::path& ckpt_dir, int64_t step,
                           const std::vector<NamedTensor>& params) {
  const fs::path dir = committed_step_dir(ckpt_dir, step);
  const Manifest manifest = read_manifest(dir);
  State state;
  for (const NamedTensor& p : params) state.add(kModelPrefix + p.name, p.tensor.detach());
  LoadOptions load;  // strict: every "model/" tensor must be asked for
  for (const TensorRecord& r : manifest.tensors)
    if (!starts_with(r.name, kModelPrefix)) load.leave_out.push_back(r.name);
  for (const auto& [name, text] : manifest.blobs) load.leave_out.push_back(name);
  comm::InMemoryStore store;
  Checkpointer checkpointer(store, {.dir = ckpt_dir});
  return checkpointer.load(manifest.step, state, load);
}

}  // namespace loom::ckpt
