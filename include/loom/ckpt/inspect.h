// Reading a checkpoint directory without a Checkpointer or a Store: which steps are committed,
// what a step holds, and whether every byte of it is intact. `loom ckpt ls|show|verify` print
// these; a program can call them on any checkpoint directory (docs/checkpoint.md). Every
// function is self-contained and may be called from any thread.
//
//   for (int64_t step : loom::ckpt::committed_steps("runs/gpt/ckpt"))
//     std::cout << step << " " << loom::ckpt::describe_step("runs/gpt/ckpt", step).bytes << "\n";
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::ckpt {

// Steps under dir whose directory holds a manifest (the commit point), ascending. A missing
// dir has none.
LOOM_API std::vector<int64_t> committed_steps(const std::filesystem::path& dir);
// Step directories under dir without a manifest: interrupted or failed saves, not checkpoints.
LOOM_API std::vector<std::filesystem::path> uncommitted_dirs(const std::filesystem::path& dir);
// <dir>/step_<N> (zero-padded): where step N lives, committed or not.
LOOM_API std::filesystem::path step_path(const std::filesystem::path& dir, int64_t step);

struct TensorSummary {
  std::string name;            // "model/<parameter>", "optim/<parameter>/<state>", ...
  std::string dtype;           // "float32", "bfloat16", ...
  std::vector<int64_t> shape;  // the global shape, whatever the sharding
  std::string kind;            // how it was saved: "replicated", "rows" or "flat"
  size_t pieces = 0;           // the pieces its elements were written in
  uint64_t bytes = 0;          // the bytes of its pieces
};

struct StepSummary {
  int64_t step = 0;
  std::filesystem::path path;                // the step directory
  int world_size = 0;                        // ranks that saved it
  uint64_t bytes = 0;                        // data files' total size
  size_t files = 0;                          // data files
  std::vector<TensorSummary> tensors;        // in the manifest's order
  std::map<std::string, std::string> blobs;  // metadata: name -> JSON text
};

// A committed step's manifest, summarised. A step that is not committed is IoError naming the
// manifest it lacks; a malformed manifest is CorruptData naming it.
LOOM_API StepSummary describe_step(const std::filesystem::path& dir, int64_t step);

// Reads every byte of a committed step and checks every hash; returns the bytes read. A hash
// mismatch is CorruptData naming the tensor and file; a missing or short data file IoError.
LOOM_API uint64_t verify_step(const std::filesystem::path& dir, int64_t step);

}  // namespace loom::ckpt
