// `loom ckpt ls|verify|show <dir> [step]`: list committed checkpoints, check every byte
// against its hash, and print a step's tensors and metadata.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckpt/manifest.h"
#include "ckpt/reader.h"
#include "ckpt/storage.h"
#include "commands.h"
#include "loom/error.h"

namespace loom::cli {
namespace {

struct CkptArgs {
  std::string dir;
  std::optional<int64_t> step;
};

// "1.5 GiB".
std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// The step asked for, or the newest committed one. InvalidArgument (exit 2) when none.
int64_t resolve_step(const CkptArgs& args) {
  LOOM_CHECK(std::filesystem::is_directory(args.dir), InvalidArgument, "no directory ", args.dir);
  if (args.step) {
    const auto dir = std::filesystem::path(args.dir) / ckpt::step_dir_name(*args.step);
    LOOM_CHECK(std::filesystem::exists(dir / ckpt::kManifestName), InvalidArgument, "step ",
               *args.step, " is not a committed checkpoint in ", args.dir, " (no ",
               (dir / ckpt::kManifestName).string(), ")");
    return *args.step;
  }
  auto steps = ckpt::committed_steps(args.dir);
  LOOM_CHECK(!steps.empty(), InvalidArgument, "no committed checkpoint in ", args.dir);
  return steps.back();
}

int run_ls(const CkptArgs& args) {
  LOOM_CHECK(std::filesystem::is_directory(args.dir), InvalidArgument, "no directory ", args.dir);
  auto steps = ckpt::committed_steps(args.dir);
  std::printf("%-12s %12s %6s %8s  %s\n", "step", "size", "ranks", "tensors", "path");
  for (int64_t step : steps) {
    const auto dir = std::filesystem::path(args.dir) / ckpt::step_dir_name(step);
    try {
      ckpt::Manifest m = ckpt::read_manifest(dir);
      std::printf("%-12lld %12s %6d %8zu  %s\n", static_cast<long long>(step),
                  bytes_text(static_cast<double>(m.data_bytes())).c_str(), m.world_size,
                  m.tensors.size(), dir.c_str());
    } catch (const Error& e) {
      std::printf("%-12lld %12s %6s %8s  %s (unreadable manifest: %s)\n",
                  static_cast<long long>(step), "?", "?", "?", dir.c_str(), e.what());
    }
  }
  const auto partial = ckpt::uncommitted_dirs(args.dir);
  if (!partial.empty()) {
    std::printf(
        "(%zu director%s without a manifest: interrupted or failed saves, not "
        "checkpoints)\n",
        partial.size(), partial.size() == 1 ? "y" : "ies");
  }
  if (steps.empty()) std::printf("(no committed checkpoint)\n");
  return kExitOk;
}

int run_verify(const CkptArgs& args) {
  const int64_t step = resolve_step(args);
  const auto dir = std::filesystem::path(args.dir) / ckpt::step_dir_name(step);
  try {
    ckpt::StepReader reader(ckpt::posix_storage(), dir, ckpt::read_manifest(dir));
    const uint64_t bytes = reader.verify_all();
    std::printf("step %lld: %zu tensors, %s in %zu files: every hash matches\n",
                static_cast<long long>(step), reader.manifest().tensors.size(),
                bytes_text(static_cast<double>(bytes)).c_str(), reader.manifest().files.size());
    return kExitOk;
  } catch (const CorruptData& e) {
    std::printf("CORRUPT: %s\n", e.what());
    return kExitFailed;
  } catch (const IoError& e) {  // a data file missing or unreadable
    std::printf("UNREADABLE: %s\n", e.what());
    return kExitFailed;
  }
}

int run_show(const CkptArgs& args) {
  const int64_t step = resolve_step(args);
  const auto dir = std::filesystem::path(args.dir) / ckpt::step_dir_name(step);
  ckpt::Manifest m = ckpt::read_manifest(dir);
  std::printf("step %lld in %s: saved by %d rank%s, %s in %zu files\n",
              static_cast<long long>(step), dir.c_str(), m.world_size, m.world_size == 1 ? "" : "s",
              bytes_text(static_cast<double>(m.data_bytes())).c_str(), m.files.size());
  std::printf("\n%-40s %-9s %-20s %-10s %6s %12s\n", "tensor", "dtype", "shape", "saved as",
              "pieces", "size");
  for (const auto& t : m.tensors) {
    uint64_t bytes = 0;
    for (const auto& p : t.pieces) bytes += p.bytes;
    std::printf("%-40s %-9s %-20s %-10s %6zu %12s\n", t.name.c_str(), t.dtype.c_str(),
                shape_text(t.shape).c_str(), t.kind.c_str(), t.pieces.size(),
                bytes_text(static_cast<double>(bytes)).c_str());
  }
  if (!m.blobs.empty()) std::printf("\nmetadata:\n");
  for (const auto& [name, text] : m.blobs)
    std::printf("%s = %s\n", name.c_str(), nlohmann::json::parse(text).dump().c_str());
  return kExitOk;
}

void add_step_command(CLI::App* ckpt, const std::string& name, const std::string& description,
                      const std::string& footer, int (*run)(const CkptArgs&), Action& action,
                      bool takes_step) {
  auto args = std::make_shared<CkptArgs>();
  CLI::App* command = ckpt->add_subcommand(name, description);
  command->add_option("dir", args->dir, "the checkpoint directory")->required();
  if (takes_step)
    command->add_option("step", args->step, "the step (default: the newest committed)");
  command->footer(footer);
  command->callback([args, run, &action] { action = [args, run] { return run(*args); }; });
}

}  // namespace

void register_ckpt(CLI::App& app, Action& action) {
  CLI::App* ckpt = app.add_subcommand("ckpt", "Inspect and verify Loom checkpoints.");
  ckpt->require_subcommand(1);
  ckpt->footer(
      "A checkpoint directory holds step_<N>/ directories; one is a checkpoint once\n"
      "its manifest.json exists (see docs/checkpoint.md).");
  add_step_command(ckpt, "ls", "List the committed steps with their sizes.",
                   "Exit codes: 0 listed, 2 no such directory.", run_ls, action, false);
  add_step_command(ckpt, "verify", "Read every byte of a step and check every hash.",
                   "Exit codes: 0 every hash matches, 1 a tensor is corrupt or a file unreadable\n"
                   "(the tensor and file are named), 2 no such directory or step.",
                   run_verify, action, true);
  add_step_command(ckpt, "show", "Print a step's tensors (dtype, shape, sharding) and metadata.",
                   "Exit codes: 0 shown, 2 no such directory or step.", run_show, action, true);
}

}  // namespace loom::cli
