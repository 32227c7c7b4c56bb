// `loom data verify|show` and the `data` command itself (build lives in data_build.cpp).
#include <ATen/ATen.h>
#include <unistd.h>

#include <iostream>
#include <memory>
#include <string>

#include "data_commands.h"
#include "loom/data/cache.h"
#include "loom/data/reader.h"
#include "loom/data/registry.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "progress.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;

int run_verify(const std::string& spec) {
  data::Manifest m;
  std::string dir;
  try {
    dir = data::resolve_dataset(spec).dir.string();
    m = data::read_manifest(dir, data::RemoteOptions{});
  } catch (const Error& e) {  // no dataset there, or a manifest that cannot be trusted
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  }
  Progress progress("verifying", m.total_bytes(), "bytes");
  auto update = [&](uint64_t done, uint64_t) { progress.update(done); };
  data::VerifyReport report;
  if (data::is_remote(dir)) {  // every file downloaded through the node cache, then checked
    data::NodeCache cache(data::CacheOptions{}, data::RemoteOptions{});
    report = data::verify_remote_dataset(dir, cache, update);
  } else {
    report = data::verify_dataset(dir, update);
  }
  progress.finish(report.bytes_checked);
  if (!report.ok) {
    std::cout << "CORRUPT: " << report.file;
    if (report.record >= 0)
      std::cout << " record " << report.record << " (byte offset " << report.offset << ")";
    std::cout << ": " << report.problem << "\n";
    return kExitFailed;
  }
  std::cout << "ok: " << dir << ": " << m.shards.size() << " shards, " << m.total_bytes()
            << " bytes, every shard hash"
            << (m.kind == data::DatasetKind::kRecords ? " and record checksum" : "")
            << " matches; version " << m.version << "\n";
  return kExitOk;
}

struct ShowArgs {
  DataPosition at;
  int rank = 0;
  uint64_t step = 0;
  bool ids = false;
  std::string color = "auto";
};

// Terminal styling: ANSI colours or plain text.
struct Style {
  bool color;
  std::string bg(int gray) const { return color ? "\033[48;5;" + std::to_string(gray) + "m" : ""; }
  std::string fg(int gray) const { return color ? "\033[38;5;" + std::to_string(gray) + "m" : ""; }
  std::string reset() const { return color ? "\033[0m" : ""; }
  std::string bold(const std::string& s) const { return color ? "\033[1m" + s + "\033[0m" : s; }
};

// A [H, W] uint8 image as terminal art: half blocks in 24 grays, or an ASCII ramp two rows per
// line.
void print_image(const at::Tensor& image, const Style& style) {
  const auto a = image.accessor<uint8_t, 2>();
  const int64_t h = image.size(0), w = image.size(1);
  const char* ramp = " .:-=+*#%@";
  for (int64_t y = 0; y < h; y += 2) {
    std::cout << "    ";
    for (int64_t x = 0; x < w; ++x) {
      const int top = a[y][x], bottom = y + 1 < h ? a[y + 1][x] : 0;
      if (style.color) {
        std::cout << style.fg(232 + top * 23 / 255) << style.bg(232 + bottom * 23 / 255)
                  << "\u2580";
      } else {
        std::cout << ramp[(top + bottom) / 2 * 9 / 255];
      }
    }
    std::cout << style.reset() << "\n";
  }
}

void print_tokens(const at::Tensor& row, const at::Tensor& mask, const data::Vocabulary* vocab,
                  const Style& style, bool ids) {
  std::string line = "    ";
  for (int64_t k = 0; k < row.size(0); ++k) {
    if (mask.defined() && !mask[k].item<bool>()) break;
    const int id = static_cast<int>(row[k].item<int64_t>());
    const std::string piece = vocab != nullptr ? vocab->text(id) : std::to_string(id);
    if (style.color) {
      line += style.bg(k % 2 ? 238 : 235) + piece + style.reset();
    } else {
      line += (k ? "|" : "") + piece;
    }
  }
  std::cout << line << "\n";
  if (ids) {
    std::cout << "    ids:";
    for (int64_t k = 0; k < row.size(0); ++k) std::cout << " " << row[k].item<int64_t>();
    std::cout << "\n";
  }
}

void print_record_field(const data::Field& field, const data::Batch& batch, int64_t r,
                        const Style& style) {
  std::cout << "  " << field.name << ": ";
  switch (field.type) {
    case data::FieldType::kText:
      std::cout << '"' << batch.strings.at(field.name)[r] << "\"\n";
      return;
    case data::FieldType::kBytes: {
      const std::string& b = batch.strings.at(field.name)[r];
      std::cout << b.size() << " bytes\n";
      return;
    }
    case data::FieldType::kInt: {
      const int64_t v = batch[field.name][r].item<int64_t>();
      std::cout << v;
      if (v >= 0 && v < static_cast<int64_t>(field.classes.size()))
        std::cout << " (" << field.classes[v] << ")";
      std::cout << "\n";
      return;
    }
    case data::FieldType::kFloat:
      std::cout << batch[field.name][r].item<double>() << "\n";
      return;
    case data::FieldType::kTensor: {
      const at::Tensor t = batch[field.name][r];
      std::cout << field.dtype << " " << t.sizes() << "\n";
      if (t.dim() == 2 && t.scalar_type() == at::kByte) {
        print_image(t, style);
      } else {
        const at::Tensor flat = t.flatten().to(at::kDouble);
        std::cout << "    ";
        for (int64_t k = 0; k < std::min<int64_t>(16, flat.numel()); ++k)
          std::cout << flat[k].item<double>() << " ";
        std::cout << (flat.numel() > 16 ? "..." : "") << "\n";
      }
      return;
    }
  }
}

int run_show(const ShowArgs& args) {
  const std::unique_ptr<data::Reader> positioned = reader_at(args.at, args.rank, args.step);
  data::Reader& reader = *positioned;
  const data::Manifest& m = reader.manifest();
  const uint64_t steps = reader.steps_per_epoch();
  const data::Batch batch = reader.next();
  const Style style{args.color == "always" || (args.color == "auto" && isatty(1))};

  std::cout << style.bold("dataset " + args.at.dir) << " (version " << m.version << ", "
            << reader.num_samples() << " samples)\n"
            << "rank " << args.rank << " of " << args.at.world << ", step " << args.step
            << " = epoch " << batch.epoch << " step " << args.step % steps << " of " << steps
            << ", seed " << args.at.seed << ", " << args.at.batch << " samples per rank\n";
  std::unique_ptr<data::Vocabulary> vocab;
  if (m.kind == data::DatasetKind::kTokens && !m.tokenizer.empty()) {
    vocab = std::make_unique<data::Vocabulary>(data::Vocabulary::of_dataset(reader.dataset().dir));
  }
  for (int64_t r = 0; r < static_cast<int64_t>(batch.indices.size()); ++r) {
    std::cout << style.bold("sample " + std::to_string(r)) << ": dataset index " << batch.indices[r]
              << (r >= batch.num_real ? " (padding: masked out)" : "") << "\n";
    if (m.kind == data::DatasetKind::kTokens) {
      const auto mask = batch.tensors.count("mask") ? batch["mask"][r] : at::Tensor();
      print_tokens(batch["tokens"][r], mask, vocab.get(), style, args.ids);
    } else {
      for (const data::Field& field : m.schema) print_record_field(field, batch, r, style);
    }
  }
  return kExitOk;
}

}  // namespace

void add_position_options(CLI::App& s, DataPosition& p) {
  s.add_option("--world", p.world, "ranks reading together")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  s.add_option("--batch", p.batch, "samples per rank per step")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  s.add_option("--seq-len", p.seq_len, "token datasets: T (a sample holds T + 1 tokens)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  s.add_option("--seed", p.seed, "the run's data seed")->capture_default_str();
  s.add_option("--sampling", p.sampling, "token datasets: packed or document")
      ->capture_default_str()
      ->check(CLI::IsMember({"packed", "document"}));
  s.add_option("--epoch-end", p.epoch_end, "drop or pad")
      ->capture_default_str()
      ->check(CLI::IsMember({"drop", "pad"}));
}

std::unique_ptr<data::Reader> reader_at(const DataPosition& p, int rank, uint64_t step) {
  LOOM_CHECK(rank >= 0 && rank < p.world, InvalidArgument, "rank ", rank,
             " is not a rank of a world of ", p.world, " (0 to ", p.world - 1, ")");
  data::ReaderOptions options{
      .batch_size = p.batch,
      .seq_len = p.seq_len,
      .sampling =
          p.sampling == "document" ? data::TokenSampling::kDocument : data::TokenSampling::kPacked,
      .seed = p.seed,
      .rank = rank,
      .world_size = p.world,
      .epoch_end = p.epoch_end == "pad" ? data::EpochEnd::kPad : data::EpochEnd::kDropLast,
      .prefetch = 0};
  auto reader = std::make_unique<data::Reader>(p.dir, options);
  const uint64_t steps = reader->steps_per_epoch();
  const uint64_t global_batch = static_cast<uint64_t>(p.batch) * static_cast<uint64_t>(p.world);
  reader->restore({reader->manifest().version, p.seed, step / steps, step % steps * global_batch});
  return reader;
}

void register_data(CLI::App& app, Action& action) {
  CLI::App* data = app.add_subcommand("data", "Build, verify and look into datasets.");
  data->require_subcommand(1);
  data->footer(
      "Formats and guarantees: docs/data-format.md; the sample order: docs/data-order.md.");
  register_data_build(*data, action);
  register_data_registry(*data, action);
  register_data_serve(*data, action);

  auto verify_dir = std::make_shared<std::string>();
  CLI::App* verify = data->add_subcommand("verify", "Check every shard hash and record checksum.");
  verify->add_option("dataset", *verify_dir, "the dataset directory, URL or registry name")
      ->required();
  verify->footer(
      "A remote dataset (http(s)://, s3://) is downloaded file by file through the node cache\n"
      "($LOOM_DATA_CACHE, $LOOM_DATA_CACHE_LIMIT) and checked there.\n"
      "Exit codes: 0 intact, 1 corrupt (the first bad shard or record is named), 2 unreadable.");
  verify->callback(
      [verify_dir, &action] { action = [verify_dir] { return run_verify(*verify_dir); }; });

  auto show = std::make_shared<ShowArgs>();
  CLI::App* s = data->add_subcommand("show", "Print the samples a rank reads at a step, decoded.");
  s->add_option("dataset", show->at.dir, "the dataset directory, URL or registry name")->required();
  s->add_option("--rank", show->rank, "the rank")->capture_default_str();
  s->add_option("--step", show->step, "the training step (counting from 0 over all epochs)")
      ->capture_default_str();
  add_position_options(*s, show->at);
  s->add_flag("--ids", show->ids, "also print token ids");
  s->add_option("--color", show->color, "auto, always or never")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "always", "never"}));
  s->footer(
      "With the options your run uses, this prints exactly the samples the model sees on that\n"
      "rank at that step: text detokenized with token boundaries marked (| or alternating\n"
      "shades), images as terminal art with their label, other fields as values.");
  s->callback([show, &action] { action = [show] { return run_show(*show); }; });
}

}  // namespace loom::cli
