// Checkpoints to and from the files PyTorch users exchange weights in: torch.save's zip
// format (a dict name -> tensor, what torch.load returns) and safetensors. The `loom ckpt
// export` and `loom ckpt import` commands are these functions; docs/checkpoint.md.
//
//   auto tensors = loom::ckpt::read_model_tensors("runs/gpt/ckpt", 1000, {});  // full tensors
//   loom::ckpt::write_tensor_file("gpt.safetensors", TensorFileFormat::kSafetensors, tensors);
//
// Names: a Loom model's parameters are saved as "model/<parameter name>" (DataParallel) and
// exported as "<parameter name>", so that the keys match the PyTorch module's state_dict();
// optimizer state ("optim/<parameter>/<state>") is exported, on request, under its Loom name.
// Import reverses this. Not thread-safe; every function is self-contained.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::ckpt {

enum class TensorFileFormat {
  kTorch,        // torch.save's zip archive of a pickled dict name -> tensor
  kSafetensors,  // 8-byte little-endian header length, JSON header, raw little-endian bytes
};

// "torch" or "safetensors"; anything else is InvalidArgument naming both.
LOOM_API TensorFileFormat parse_tensor_file_format(const std::string& name);

struct NamedTensor {
  std::string name;
  at::Tensor tensor;  // contiguous, on the CPU
};

struct ReadModelOptions {
  bool optimizer = false;  // also the "optim/..." tensors, under their Loom names
  bool verify = true;      // check every chunk's hash while reading
};

// The full tensors of committed `step` of `ckpt_dir`, whatever their sharding at save time
// (ZeRO's flat pieces, rows, replicated), in the manifest's order. When the step has
// "model/..." tensors these come with the prefix stripped, plus with options.optimizer the
// "optim/..." ones; other tensors (the per-rank RNG) are left out. A step without "model/"
// tensors (a program's own names) gives every tensor under its saved name. No such step is
// InvalidArgument; bad bytes are CorruptData naming tensor and file.
LOOM_API std::vector<NamedTensor> read_model_tensors(const std::filesystem::path& ckpt_dir,
                                                     int64_t step, const ReadModelOptions& options);

// Writes the tensors to `path` (atomically: a temporary file renamed over it). metadata goes
// to safetensors' "__metadata__" (string -> string); the torch format has no place for it.
// A dtype the format cannot hold (complex in safetensors) is InvalidArgument naming it.
LOOM_API void write_tensor_file(const std::filesystem::path& path, TensorFileFormat format,
                                const std::vector<NamedTensor>& tensors,
                                const std::map<std::string, std::string>& metadata = {});

// Reads a file write_tensor_file, Python's torch.save(dict of tensors) or any safetensors
// writer made. A file that is not one (truncated, a header or offsets outside the file, an
// unknown dtype, a torch file whose object is not a dict of tensors) is CorruptData naming
// the file and what is wrong; a missing file is IoError.
LOOM_API std::vector<NamedTensor> read_tensor_file(const std::filesystem::path& path,
                                                   TensorFileFormat format);

struct ImportOptions {
  TensorFileFormat format = TensorFileFormat::kSafetensors;
  int64_t step = 0;  // the step the imported checkpoint is committed as
};

// Builds committed step options.step in `ckpt_dir` (through Checkpointer: the usual manifest,
// hashes and commit) from a tensor file: every tensor as a replicated "model/<name>", except
// names already starting with "optim/", kept as they are, plus a JSON blob "imported" naming
// the source file and format. Returns the tensors imported. A step already committed there is
// InvalidArgument. load_model_weights() reads the result into a model.
LOOM_API std::vector<NamedTensor> import_tensor_file(const std::filesystem::path& in,
                                                     const std::filesystem::path& ckpt_dir,
                                                     const ImportOptions& options);

// Fills `params` (a module's named parameters and buffers, e.g. from named_parameters(), each
// allocated with its shape and dtype) in place from the "model/<name>" tensors of `step`
// (Checkpointer::kLatest = -1: the newest committed), strictly: a parameter the step lacks, or
// one of another shape or dtype, is InvalidArgument naming it; "model/" tensors the caller did
// not ask for are too. Other tensors and blobs (optimizer state, trainer state) are left out.
// Call it before wrapping the module in DataParallel, which takes the module's weights
// (rank 0's) at construction. Returns the step loaded.
LOOM_API int64_t load_model_weights(const std::filesystem::path& ckpt_dir, int64_t step,
                                    const std::vector<NamedTensor>& params);

}  // namespace loom::ckpt
