// `loom ckpt ls|verify|show <dir> [step]`: list committed checkpoints, check every byte
// against its hash, and print a step's tensors and metadata. `loom ckpt export|import`:
// to and from torch.save and safetensors files (loom/ckpt/export.h).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "commands.h"
#include "loom/ckpt/export.h"
#include "loom/ckpt/inspect.h"
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
  const auto steps = ckpt::committed_steps(args.dir);
  LOOM_CHECK(!steps.empty(), InvalidArgument, "no committed checkpoint in ", args.dir);
  if (!args.step) return steps.back();
  if (std::find(steps.begin(), steps.end(), *args.step) == steps.end()) {
    std::string committed;
    for (int64_t step : steps) committed += (committed.empty() ? "" : ", ") + std::to_string(step);
    throw InvalidArgument(detail::concat("step ", *args.step, " is not a committed checkpoint in ",
                                         args.dir, " (committed steps: ", committed, ")"));
  }
  return *args.step;
}

int run_ls(const CkptArgs& args) {
  LOOM_CHECK(std::filesystem::is_directory(args.dir), InvalidArgument, "no directory ", args.dir);
  auto steps = ckpt::committed_steps(args.dir);
  std::printf("%-12s %12s %6s %8s  %s\n", "step", "size", "ranks", "tensors", "path");
  for (int64_t step : steps) {
    try {
      const ckpt::StepSummary s = ckpt::describe_step(args.dir, step);
      std::printf("%-12lld %12s %6d %8zu  %s\n", static_cast<long long>(step),
                  bytes_text(static_cast<double>(s.bytes)).c_str(), s.world_size, s.tensors.size(),
                  s.path.c_str());
    } catch (const Error& e) {
      std::printf("%-12lld %12s %6s %8s  %s (unreadable manifest: %s)\n",
                  static_cast<long long>(step), "?", "?", "?",
                  ckpt::step_path(args.dir, step).c_str(), e.what());
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
  try {
    const ckpt::StepSummary s = ckpt::describe_step(args.dir, step);
    const uint64_t bytes = ckpt::verify_step(args.dir, step);
    std::printf("step %lld: %zu tensors, %s in %zu files: every hash matches\n",
                static_cast<long long>(step), s.tensors.size(),
                bytes_text(static_cast<double>(bytes)).c_str(), s.files);
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
  const ckpt::StepSummary s = ckpt::describe_step(args.dir, step);
  std::printf("step %lld in %s: saved by %d rank%s, %s in %zu files\n",
              static_cast<long long>(step), s.path.c_str(), s.world_size,
              s.world_size == 1 ? "" : "s", bytes_text(static_cast<double>(s.bytes)).c_str(),
              s.files);
  std::printf("\n%-40s %-9s %-20s %-10s %6s %12s\n", "tensor", "dtype", "shape", "saved as",
              "pieces", "size");
  for (const auto& t : s.tensors) {
    std::printf("%-40s %-9s %-20s %-10s %6zu %12s\n", t.name.c_str(), t.dtype.c_str(),
                shape_text(t.shape).c_str(), t.kind.c_str(), t.pieces,
                bytes_text(static_cast<double>(t.bytes)).c_str());
  }
  if (!s.blobs.empty()) std::printf("\nmetadata:\n");
  for (const auto& [name, text] : s.blobs)
    std::printf("%s = %s\n", name.c_str(), nlohmann::json::parse(text).dump().c_str());
  return kExitOk;
}

struct ExportArgs {
  std::string dir;
  std::string step = "latest";
  std::string format;
  std::string out;
  bool optimizer = false;
};

int run_export(const ExportArgs& args) {
  LOOM_CHECK(std::filesystem::is_directory(args.dir), InvalidArgument, "no directory ", args.dir);
  const auto format = ckpt::parse_tensor_file_format(args.format);
  CkptArgs which{args.dir, std::nullopt};
  if (args.step != "latest") {
    size_t used = 0;
    try {
      which.step = std::stoll(args.step, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LOOM_CHECK(used == args.step.size() && used > 0, InvalidArgument, "step must be a number or ",
               "'latest', got '", args.step, "'");
  }
  const int64_t step = resolve_step(which);
  const auto tensors = ckpt::read_model_tensors(args.dir, step, {.optimizer = args.optimizer});
  ckpt::write_tensor_file(args.out, format, tensors,
                          {{"format", "pt"},
                           {"loom.step", std::to_string(step)},
                           {"loom.checkpoint", std::filesystem::absolute(args.dir).string()}});
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.tensor.numel() * t.tensor.element_size();
  std::printf("step %lld: %zu tensors, %s written to %s (%s)\n", static_cast<long long>(step),
              tensors.size(), bytes_text(static_cast<double>(bytes)).c_str(), args.out.c_str(),
              args.format.c_str());
  return kExitOk;
}

struct ImportArgs {
  std::string in;
  std::string format;
  std::string dir;
  int64_t step = 0;
};

int run_import(const ImportArgs& args) {
  const auto format = ckpt::parse_tensor_file_format(args.format);
  LOOM_CHECK(std::filesystem::is_regular_file(args.in), InvalidArgument, "no file ", args.in);
  try {
    const auto tensors =
        ckpt::import_tensor_file(args.in, args.dir, {.format = format, .step = args.step});
    std::printf("%s: %zu tensors imported as step %lld of %s\n", args.in.c_str(), tensors.size(),
                static_cast<long long>(args.step), args.dir.c_str());
    return kExitOk;
  } catch (const CorruptData& e) {
    std::printf("CORRUPT: %s\n", e.what());
    return kExitFailed;
  }
}

void register_interchange(CLI::App* ckpt, Action& action) {
  auto ex = std::make_shared<ExportArgs>();
  CLI::App* export_cmd = ckpt->add_subcommand(
      "export", "Write a step's model (and optimizer) tensors as a torch or safetensors file.");
  export_cmd->add_option("dir", ex->dir, "the checkpoint directory")->required();
  export_cmd->add_option("step", ex->step, "the step, or latest")->required();
  export_cmd->add_option("out", ex->out, "the file to write")->required();
  export_cmd->add_option("--format", ex->format, "torch or safetensors")->required();
  export_cmd->add_flag("--optimizer", ex->optimizer,
                       "also the optimizer state, as optim/<parameter>/<state>");
  export_cmd->footer(
      "Sharded tensors (ZeRO) are gathered whole; \"model/<name>\" is written as <name>, the\n"
      "keys of the PyTorch module's state_dict(). In Python: torch.load(out) gives a dict.\n"
      "Exit codes: 0 written, 1 the checkpoint is corrupt, 2 no such directory or step.");
  export_cmd->callback([ex, &action] { action = [ex] { return run_export(*ex); }; });

  auto im = std::make_shared<ImportArgs>();
  CLI::App* import_cmd = ckpt->add_subcommand(
      "import", "Make a committed Loom checkpoint from a torch.save or safetensors file.");
  import_cmd->add_option("in", im->in, "the file to read (a state_dict)")->required();
  import_cmd->add_option("dir", im->dir, "the checkpoint directory to write")->required();
  import_cmd->add_option("--format", im->format, "torch or safetensors")->required();
  import_cmd->add_option("--step", im->step, "the step to commit it as")->capture_default_str();
  import_cmd->footer(
      "Each tensor <name> becomes model/<name> (optim/... names are kept): model weights,\n"
      "for loom::ckpt::load_model_weights(); not a Trainer resume point (docs/checkpoint.md).\n"
      "Exit codes: 0 imported, 1 the file is corrupt, 2 bad arguments or an existing step.");
  import_cmd->callback([im, &action] { action = [im] { return run_import(*im); }; });
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
  CLI::App* ckpt = app.add_subcommand(
      "ckpt", "Inspect and verify Loom checkpoints; export and import them for PyTorch.");
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
  register_interchange(ckpt, action);
}

}  // namespace loom::cli
