// `loom data verify|show` and the `data` command itself (build lives in data_build.cpp).
#include <ATen/ATen.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "data/run_readers.h"
#include "data_commands.h"
#include "loom/ckpt/inspect.h"
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
  bool interactive = false;
  const CLI::Option* step_option = nullptr;  // whether --step was given
  std::optional<uint64_t> resume;            // a run directory's resume step (from_run)
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
void print_image(std::ostream& out, const at::Tensor& image, const Style& style) {
  const auto a = image.accessor<uint8_t, 2>();
  const int64_t h = image.size(0), w = image.size(1);
  const char* ramp = " .:-=+*#%@";
  for (int64_t y = 0; y < h; y += 2) {
    out << "    ";
    for (int64_t x = 0; x < w; ++x) {
      const int top = a[y][x], bottom = y + 1 < h ? a[y + 1][x] : 0;
      if (style.color) {
        out << style.fg(232 + top * 23 / 255) << style.bg(232 + bottom * 23 / 255) << "\u2580";
      } else {
        out << ramp[(top + bottom) / 2 * 9 / 255];
      }
    }
    out << style.reset() << "\n";
  }
}

// An [H, W, C] uint8 image (C 1 to 4) as terminal art at most kArtColumns wide: half blocks in
// 24-bit colour, or an ASCII ramp of its luma two rows per line.
constexpr int64_t kArtColumns = 64;

void print_color_image(std::ostream& out, const at::Tensor& image, const Style& style) {
  const at::Tensor hwc = image.contiguous();
  const int64_t h = hwc.size(0), w = hwc.size(1), c = hwc.size(2);
  const int64_t stride = (w + kArtColumns - 1) / kArtColumns;  // pixels per column and half row
  const uint8_t* p = hwc.data_ptr<uint8_t>();
  auto rgb = [&](int64_t y, int64_t x) -> std::array<int, 3> {
    if (y >= h) return {0, 0, 0};
    const uint8_t* px = p + (y * w + x) * c;
    return c >= 3 ? std::array<int, 3>{px[0], px[1], px[2]}
                  : std::array<int, 3>{px[0], px[0], px[0]};
  };
  const char* ramp = " .:-=+*#%@";
  for (int64_t y = 0; y < h; y += 2 * stride) {
    out << "    ";
    for (int64_t x = 0; x < w; x += stride) {
      const auto top = rgb(y, x), bottom = rgb(y + stride, x);
      if (style.color) {
        out << "\033[38;2;" << top[0] << ";" << top[1] << ";" << top[2] << "m\033[48;2;"
            << bottom[0] << ";" << bottom[1] << ";" << bottom[2] << "m\u2580";
      } else {
        const int luma =
            (299 * (top[0] + bottom[0]) + 587 * (top[1] + bottom[1]) + 114 * (top[2] + bottom[2])) /
            2000;
        out << ramp[luma * 9 / 255];
      }
    }
    out << style.reset() << "\n";
  }
}

// Up to `limit` values of a tensor, flattened, and "..." when there are more.
std::string values_text(const at::Tensor& t, int64_t limit = 16) {
  const at::Tensor flat = t.flatten().to(at::kDouble);
  std::ostringstream out;
  for (int64_t k = 0; k < std::min<int64_t>(limit, flat.numel()); ++k) {
    out << (k ? " " : "") << flat[k].item<double>();
  }
  if (flat.numel() > limit) out << " ...";
  return out.str();
}

// One line per value of a per-step series, drawn from the lowest to the highest: ▁ to █.
std::string sparkline(const at::Tensor& values) {
  const at::Tensor v = values.to(at::kDouble).contiguous();
  const double* d = v.data_ptr<double>();
  const int64_t n = v.numel();
  if (n == 0) return "";
  const double lo = *std::min_element(d, d + n), hi = *std::max_element(d, d + n);
  static const char* const kBars[] = {"\u2581", "\u2582", "\u2583", "\u2584",
                                      "\u2585", "\u2586", "\u2587", "\u2588"};
  std::string out;
  for (int64_t k = 0; k < n; ++k) {
    out += kBars[hi > lo ? static_cast<int>((d[k] - lo) / (hi - lo) * 7 + 0.5) : 3];
  }
  return out;
}

void print_tokens(std::ostream& out, const at::Tensor& row, const at::Tensor& mask,
                  const data::Vocabulary* vocab, const Style& style, bool ids) {
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
  out << line << "\n";
  if (ids) {
    out << "    ids:";
    for (int64_t k = 0; k < row.size(0); ++k) out << " " << row[k].item<int64_t>();
    out << "\n";
  }
}

void print_record_field(std::ostream& out, const data::Field& field, const data::Batch& batch,
                        int64_t r, const Style& style) {
  out << "  " << field.name << ": ";
  switch (field.type) {
    case data::FieldType::kText:
      out << '"' << batch.strings.at(field.name)[r] << "\"\n";
      return;
    case data::FieldType::kBytes: {
      const std::string& b = batch.strings.at(field.name)[r];
      out << b.size() << " bytes\n";
      return;
    }
    case data::FieldType::kInt: {
      const int64_t v = batch[field.name][r].item<int64_t>();
      out << v;
      if (v >= 0 && v < static_cast<int64_t>(field.classes.size()))
        out << " (" << field.classes[v] << ")";
      out << "\n";
      return;
    }
    case data::FieldType::kFloat:
      out << batch[field.name][r].item<double>() << "\n";
      return;
    case data::FieldType::kTensor: {
      const at::Tensor t = unpadded(batch, field.name, r);
      out << field.dtype << " " << t.sizes() << "\n";
      if (t.dim() == 2 && t.scalar_type() == at::kByte) {
        print_image(out, t, style);
      } else {  // each value then a space, as every earlier Loom printed it
        out << "    " << values_text(t) << (t.numel() > 0 && t.numel() <= 16 ? " " : "") << "\n";
      }
      return;
    }
    case data::FieldType::kImage: {
      const at::Tensor image = image_of(batch, field.name, r);
      out << "image " << image.sizes() << "\n";
      print_color_image(out, image, style);
      return;
    }
    case data::FieldType::kImages: {
      const at::Tensor mask = batch[field.name + "_mask"][r];
      const int64_t n = mask.sum().item<int64_t>();
      out << n << " image" << (n == 1 ? "" : "s") << "\n";
      for (int64_t k = 0; k < n; ++k) {
        const at::Tensor image = image_of(batch, field.name, r, k);
        out << "    image " << k << " " << image.sizes() << "\n";
        print_color_image(out, image, style);
      }
      return;
    }
  }
}

// A multimodal sequence: its token ids with each image's place marked, then the images.
void print_sequence(std::ostream& out, const data::Batch& batch, int64_t r, const Style& style) {
  const at::Tensor tokens = unpadded(batch, "tokens", r).to(at::kLong);
  const at::Tensor positions = unpadded(batch, "image_positions", r);
  out << "  sequence: " << tokens.size(0) << " tokens, " << positions.size(0)
      << (positions.size(0) == 1 ? " image" : " images") << "\n    ";
  int64_t k = 0;
  for (int64_t t = 0; t <= tokens.size(0); ++t) {
    for (; k < positions.size(0) && positions[k].item<int64_t>() == t; ++k) {
      const at::Tensor image = image_of(batch, "images", r, k);
      out << style.bold("<image " + std::to_string(k) + " " + std::to_string(image.size(0)) + "x" +
                        std::to_string(image.size(1)) + ">")
          << " ";
    }
    if (t < tokens.size(0)) out << tokens[t].item<int64_t>() << " ";
  }
  out << "\n";
  for (k = 0; k < positions.size(0); ++k) {
    const at::Tensor image = image_of(batch, "images", r, k);
    out << "    image " << k << " " << image.sizes() << "\n";
    print_color_image(out, image, style);
  }
}

// A whole episode: its length, per-step reward and return (and advantage) as sparklines, and
// the first steps as a table.
void print_episode(std::ostream& out, const data::Batch& batch, int64_t r) {
  const at::Tensor reward = unpadded(batch, "reward", r);
  const int64_t n = reward.size(0);
  const at::Tensor ret = batch["return"][r].narrow(0, 0, n);
  const bool has_advantage = batch.tensors.count("advantage") > 0;
  out << "  episode: " << n << " steps, total reward " << reward.sum().item<double>() << ", return "
      << ret[0].item<double>() << "\n"
      << "    reward " << sparkline(reward) << "\n"
      << "    return " << sparkline(ret) << "\n";
  out << "    step  action  reward  done  return" << (has_advantage ? "  advantage" : "") << "\n";
  const at::Tensor action = unpadded(batch, "action", r), done = unpadded(batch, "done", r);
  for (int64_t t = 0; t < std::min<int64_t>(n, 8); ++t) {
    out << "    " << t << "  " << values_text(action[t], 4) << "  " << reward[t].item<double>()
        << "  " << done[t].to(at::kLong).item<int64_t>() << "  " << ret[t].item<double>();
    if (has_advantage) out << "  " << batch["advantage"][r][t].item<double>();
    out << "\n";
  }
  if (n > 8) out << "    ... " << n - 8 << " more steps\n";
}

// The samples rank `rank` reads at `step`, as `loom data show` prints them.
void print_show(std::ostream& out, const ShowArgs& args, int rank, uint64_t step,
                const Style& style) {
  const bool mixed = !args.at.mix.empty();
  const std::unique_ptr<data::Reader> positioned = reader_at(args.at, rank, mixed ? 0 : step);
  data::Reader& reader = *positioned;
  const data::Manifest& m = reader.manifest();
  const uint64_t steps = reader.steps_per_epoch();
  const data::Batch batch = mixed ? mixture_at(args.at, rank, step)->next() : reader.next();
  if (args.resume) {
    out << style.bold("run " + args.at.run) << ": reader " << args.at.reader << "; "
        << (args.at.checkpointed ? "its newest checkpoint resumes at step "
                                 : "no checkpoint yet, so from step ")
        << *args.resume << "\n";
  }
  if (mixed) {
    out << style.bold("mixture of " + std::to_string(args.at.mix.size()) + " datasets") << ":";
    for (size_t k = 0; k < args.at.mix.size(); ++k) {
      const data::RunReader::Source& source = args.at.mix[k];
      out << (k ? "," : "") << " " << k << ": " << source.dataset << " (weight " << source.weight
          << (source.stop ? ", one epoch" : "") << ")";
    }
    out << "\nrank " << rank << " of " << args.at.world << ", step " << step << ", seed "
        << args.at.seed << ", " << args.at.batch << " samples per rank\n";
  } else {
    out << style.bold("dataset " + args.at.dir) << " (version " << m.version << ", "
        << reader.num_samples() << " samples)\n"
        << "rank " << rank << " of " << args.at.world << ", step " << step << " = epoch "
        << batch.epoch << " step " << step % steps << " of " << steps << ", seed " << args.at.seed
        << ", " << args.at.batch << " samples per rank\n";
  }
  std::unique_ptr<data::Vocabulary> vocab;
  if (m.kind == data::DatasetKind::kTokens && !m.tokenizer.empty()) {
    vocab = std::make_unique<data::Vocabulary>(data::Vocabulary::of_dataset(reader.dataset().dir));
  }
  for (int64_t r = 0; r < static_cast<int64_t>(batch.indices.size()); ++r) {
    out << style.bold("sample " + std::to_string(r)) << ": "
        << (mixed ? "source " + std::to_string(batch.sources[r]) + ", " : "") << "dataset index "
        << batch.indices[r] << (r >= batch.num_real ? " (padding: masked out)" : "") << "\n";
    if (m.kind == data::DatasetKind::kTokens) {
      const auto mask = batch.tensors.count("mask") ? batch["mask"][r] : at::Tensor();
      print_tokens(out, batch["tokens"][r], mask, vocab.get(), style, args.ids);
      continue;
    }
    const bool transitions = batch.tensors.count("step") > 0;
    if (transitions) {
      out << "  episode " << batch["episode"][r].item<int64_t>() << ", step "
          << batch["step"][r].item<int64_t>() << ": return " << batch["return"][r].item<double>();
      if (batch.tensors.count("advantage")) {
        out << ", advantage " << batch["advantage"][r].item<double>();
      }
      out << "\n";
    } else if (m.layout == data::RecordLayout::kEpisodes) {
      print_episode(out, batch, r);
    } else if (m.layout == data::RecordLayout::kMultimodal) {
      print_sequence(out, batch, r, style);
    }
    for (const data::Field& field : m.schema) {
      const bool shown =
          m.layout == data::RecordLayout::kMultimodal &&
          (field.name == "tokens" || field.name == "images" || field.name == "image_positions");
      if (!shown) print_record_field(out, field, batch, r, style);
    }
  }
}

// The terminal in raw mode (no echo, no line buffering) on the alternate screen while it
// lives; restored on every way out.
class RawTerminal {
 public:
  RawTerminal() {
    LOOM_CHECK(::isatty(STDIN_FILENO) == 1 && ::isatty(STDOUT_FILENO) == 1, InvalidArgument,
               "--interactive needs a terminal (stdin and stdout); without one, use "
               "`loom data show` with --rank and --step");
    ::tcgetattr(STDIN_FILENO, &saved_);
    termios raw = saved_;
    raw.c_lflag &= static_cast<tcflag_t>(~(ICANON | ECHO));
    raw.c_cc[VMIN] = 1;
    raw.c_cc[VTIME] = 0;
    ::tcsetattr(STDIN_FILENO, TCSANOW, &raw);
    std::cout << "\033[?1049h\033[?25l" << std::flush;  // alternate screen, no cursor
  }
  ~RawTerminal() {
    std::cout << "\033[?25h\033[?1049l" << std::flush;
    ::tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  RawTerminal(const RawTerminal&) = delete;
  RawTerminal& operator=(const RawTerminal&) = delete;

  // The next key: a character, or "left", "right", "up", "down" for the arrows; "" at the
  // end of input.
  std::string key() {
    char c = 0;
    if (::read(STDIN_FILENO, &c, 1) != 1) return "";
    if (c != '\033') return std::string(1, c);
    char seq[2] = {};
    if (::read(STDIN_FILENO, &seq[0], 1) != 1 || ::read(STDIN_FILENO, &seq[1], 1) != 1) {
      return "\033";
    }
    if (seq[0] == '[') {
      switch (seq[1]) {
        case 'A':
          return "up";
        case 'B':
          return "down";
        case 'C':
          return "right";
        case 'D':
          return "left";
      }
    }
    return "";
  }

 private:
  termios saved_{};
};

// `loom data show --interactive`: the same view, stepping through steps and ranks with keys.
int run_interactive(const ShowArgs& args) {
  RawTerminal terminal;
  const Style style{args.color != "never"};
  int rank = args.rank;
  uint64_t step = args.step;
  std::string note;
  for (;;) {
    std::ostringstream view;
    try {
      print_show(view, args, rank, step, style);
    } catch (const Error& e) {
      view << "error: " << e.what() << "\n";
    }
    std::cout << "\033[H\033[2J" << view.str() << "\n"
              << style.bold("rank " + std::to_string(rank) + "/" + std::to_string(args.at.world) +
                            " step " + std::to_string(step))
              << "  \u2190/\u2192 or p/n: step   \u2191/\u2193 or k/j: rank   g: go to step   "
                 "q: quit"
              << (note.empty() ? "" : "   " + note) << std::flush;
    note.clear();
    const std::string key = terminal.key();
    if (key.empty() || key == "q") return kExitOk;
    if (key == "right" || key == "n") {
      ++step;
    } else if ((key == "left" || key == "p") && step > 0) {
      --step;
    } else if ((key == "down" || key == "j") && rank + 1 < args.at.world) {
      ++rank;
    } else if ((key == "up" || key == "k") && rank > 0) {
      --rank;
    } else if (key == "g") {
      std::cout << "\r\033[2Kgo to step: " << std::flush;
      std::string digits;
      for (std::string k = terminal.key(); k != "\n" && k != "\r" && !k.empty();
           k = terminal.key()) {
        if (k.size() == 1 && std::isdigit(static_cast<unsigned char>(k[0])) && digits.size() < 18) {
          digits += k;
          std::cout << k << std::flush;
        } else if ((k == "\177" || k == "\b") && !digits.empty()) {
          digits.pop_back();
          std::cout << "\b \b" << std::flush;
        }
      }
      if (!digits.empty()) step = std::stoull(digits);
    } else {
      note = "(unknown key)";
    }
  }
}

int run_show(ShowArgs args) {
  args.resume = from_run(args.at);
  if (args.resume && args.step_option->count() == 0) args.step = *args.resume;
  if (args.interactive) return run_interactive(args);
  const Style style{args.color == "always" || (args.color == "auto" && isatty(1))};
  print_show(std::cout, args, args.rank, args.step, style);
  return kExitOk;
}

}  // namespace

void add_position_options(CLI::App& s, DataPosition& p) {
  p.options = {
      s.add_option("--world", p.world, "ranks reading together")
          ->capture_default_str()
          ->check(CLI::Range(1, 1 << 20)),
      s.add_option("--batch", p.batch, "samples per rank per step")
          ->capture_default_str()
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20)),
      s.add_option("--seq-len", p.seq_len, "token datasets: T (a sample holds T + 1 tokens)")
          ->capture_default_str()
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 24)),
      s.add_option("--seed", p.seed, "the run's data seed")->capture_default_str(),
      s.add_option("--sampling", p.sampling,
                   "token datasets: packed (default) or document; episode datasets: episode "
                   "(default) or transition")
          ->check(CLI::IsMember({"packed", "document", "episode", "transition"})),
      s.add_option("--epoch-end", p.epoch_end, "drop or pad")
          ->capture_default_str()
          ->check(CLI::IsMember({"drop", "pad"})),
      s.add_option("--image-channels", p.image_channels,
                   "convert every image to this many channels (1-4); 0: as stored")
          ->capture_default_str()
          ->check(CLI::Range(0, 4))};
  s.add_option("--reader", p.reader,
               "with a run directory: which of the datasets the run opened (0: the first)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
}

std::optional<uint64_t> from_run(DataPosition& p) {
  const fs::path run = p.dir;
  if (data::is_remote(p.dir) || !fs::exists(data::run_readers_file(run))) return std::nullopt;
  for (const CLI::Option* option : p.options) {
    LOOM_CHECK(option->count() == 0, InvalidArgument, option->get_name(),
               " does not apply to a run directory: ", p.dir,
               " shows the samples with the run's own reader options (readers.json)");
  }
  const std::vector<data::RunReader> readers = data::run_readers(run);
  std::string names;
  for (size_t i = 0; i < readers.size(); ++i) {
    names += detail::concat(i ? ", " : "", i, ": ",
                            readers[i].mixture.empty()
                                ? readers[i].dataset
                                : detail::concat("a mixture of ", readers[i].mixture.size()));
  }
  LOOM_CHECK(p.reader >= 0 && static_cast<size_t>(p.reader) < readers.size(), InvalidArgument,
             "--reader ", p.reader, ": ", p.dir, " opened ", readers.size(), " dataset",
             readers.size() == 1 ? "" : "s", " (", names, ")");
  const data::RunReader& r = readers[static_cast<size_t>(p.reader)];
  const data::ReaderOptions& o = r.options;
  p.run = p.dir;
  p.dir = r.dir;
  p.world = o.world_size;
  p.batch = o.batch_size;
  p.seq_len = o.seq_len;
  p.seed = o.seed;
  p.epoch_end = o.epoch_end == data::EpochEnd::kPad ? "pad" : "drop";
  p.image_channels = o.image_channels;
  p.pad_id = o.pad_id;
  p.gamma = o.gamma;
  p.gae_lambda = o.gae_lambda;
  p.mix = r.mixture;
  std::vector<std::pair<std::string, std::string>> read;  // (dir, the version the run read)
  for (const data::RunReader::Source& source : r.mixture)
    read.emplace_back(source.dir, source.version);
  if (read.empty()) read.emplace_back(r.dir, r.version);
  data::Manifest m;  // p.dir's: the dataset's, or the mixture's first source's
  for (const auto& [dir, version] : read) {
    data::Manifest now = data::read_manifest(dir, data::RemoteOptions{});
    LOOM_CHECK(now.version == version, InvalidArgument, dir, " is now version ", now.version,
               " but the run read version ", version, "; the run's samples are not there any more");
    if (dir == p.dir) m = std::move(now);
  }
  p.sampling =
      m.kind == data::DatasetKind::kTokens
          ? (o.sampling == data::TokenSampling::kDocument ? "document" : "packed")
      : m.layout == data::RecordLayout::kEpisodes
          ? (o.episode_sampling == data::EpisodeSampling::kTransition ? "transition" : "episode")
          : "";
  const std::vector<int64_t> steps = ckpt::committed_steps(run / "ckpt");
  p.checkpointed = !steps.empty();
  if (steps.empty()) return 0;
  const ckpt::StepSummary newest = ckpt::describe_step(run / "ckpt", steps.back());
  const auto blob = newest.blobs.find("reader");
  LOOM_CHECK(blob != newest.blobs.end() && !blob->second.empty(), InvalidArgument, "checkpoint ",
             newest.path.string(), " holds no reader position; pass --step");
  const uint64_t global_batch = static_cast<uint64_t>(p.batch * p.world);
  if (!p.mix.empty()) return data::MixtureState::from_json(blob->second).slots / global_batch;
  const data::SamplerState state = data::SamplerState::from_json(blob->second);
  const uint64_t per_epoch = reader_at(p, 0, 0)->steps_per_epoch();
  return state.epoch * per_epoch + state.position / global_batch;
}

at::Tensor unpadded(const data::Batch& batch, const std::string& name, int64_t r) {
  const at::Tensor row = batch[name][r];
  const auto mask = batch.tensors.find(name + "_mask");
  if (mask == batch.tensors.end()) return row;
  return row.narrow(0, 0, mask->second[r].sum().item<int64_t>());
}

at::Tensor image_of(const data::Batch& batch, const std::string& name, int64_t r, int64_t k) {
  const at::Tensor size = k < 0 ? batch[name + "_size"][r] : batch[name + "_size"][r][k];
  const at::Tensor image = k < 0 ? batch[name][r] : batch[name][r][k];
  return image.narrow(0, 0, size[0].item<int64_t>()).narrow(1, 0, size[1].item<int64_t>());
}

std::unique_ptr<data::Reader> reader_at(const DataPosition& p, int rank, uint64_t step) {
  LOOM_CHECK(rank >= 0 && rank < p.world, InvalidArgument, "rank ", rank,
             " is not a rank of a world of ", p.world, " (0 to ", p.world - 1, ")");
  data::ReaderOptions options{
      .batch_size = p.batch,
      .seq_len = p.seq_len,
      .sampling =
          p.sampling == "document" ? data::TokenSampling::kDocument : data::TokenSampling::kPacked,
      .pad_id = p.pad_id,
      .seed = p.seed,
      .rank = rank,
      .world_size = p.world,
      .epoch_end = p.epoch_end == "pad" ? data::EpochEnd::kPad : data::EpochEnd::kDropLast,
      .episode_sampling = p.sampling == "transition" ? data::EpisodeSampling::kTransition
                                                     : data::EpisodeSampling::kEpisode,
      .gamma = p.gamma,
      .gae_lambda = p.gae_lambda,
      .image_channels = p.image_channels,
      .prefetch = 0};
  auto reader = std::make_unique<data::Reader>(p.dir, options);
  const data::Manifest& m = reader->manifest();
  const bool tokens = m.kind == data::DatasetKind::kTokens;
  const bool episodes = m.layout == data::RecordLayout::kEpisodes;
  LOOM_CHECK(p.sampling.empty() ||
                 (tokens ? p.sampling == "packed" || p.sampling == "document"
                         : episodes && (p.sampling == "episode" || p.sampling == "transition")),
             InvalidArgument, "--sampling ", p.sampling, " does not apply to ", p.dir, " (",
             tokens     ? "a token dataset: packed or document"
             : episodes ? "an episode dataset: episode or transition"
                        : "a record dataset: leave it out",
             ")");
  const uint64_t steps = reader->steps_per_epoch();
  const uint64_t global_batch = static_cast<uint64_t>(p.batch) * static_cast<uint64_t>(p.world);
  reader->restore({reader->manifest().version, p.seed, step / steps, step % steps * global_batch});
  return reader;
}

std::unique_ptr<data::Mixture> mixture_at(const DataPosition& p, int rank, uint64_t step) {
  std::vector<data::MixtureSource> sources;
  for (const data::RunReader::Source& s : p.mix) {
    sources.push_back({.dataset = s.dir,
                       .weight = s.weight,
                       .epochs = s.stop ? data::SourceEpochs::kStop : data::SourceEpochs::kRepeat});
  }
  auto mixture = std::make_unique<data::Mixture>(
      std::move(sources),
      data::MixtureOptions{.batch_size = p.batch,
                           .seq_len = p.seq_len,
                           .sampling = p.sampling == "document" ? data::TokenSampling::kDocument
                                                                : data::TokenSampling::kPacked,
                           .pad_id = p.pad_id,
                           .seed = p.seed,
                           .rank = rank,
                           .world_size = p.world});
  mixture->skip(step);
  return mixture;
}

void register_data(CLI::App& app, Action& action) {
  CLI::App* data = app.add_subcommand("data", "Build, verify and look into datasets.");
  data->require_subcommand(1);
  data->footer(
      "Formats and guarantees: docs/data-format.md; the sample order: docs/data-order.md.");
  register_data_build(*data, action);
  register_data_registry(*data, action);
  register_data_serve(*data, action);
  register_data_service(*data, action);

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
  s->add_option("dataset", show->at.dir,
                "the dataset directory, URL or registry name, or a run directory")
      ->required();
  s->add_option("--rank", show->rank, "the rank")->capture_default_str();
  show->step_option =
      s->add_option("--step", show->step,
                    "the training step (counting from 0 over all epochs); with a run directory, "
                    "default: the step its newest checkpoint resumes at")
          ->capture_default_str();
  add_position_options(*s, show->at);
  s->add_flag("--ids", show->ids, "also print token ids");
  s->add_flag("--interactive", show->interactive,
              "step through steps and ranks with the keyboard (arrows, n/p, j/k, g, q)");
  s->add_option("--color", show->color, "auto, always or never")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "always", "never"}));
  s->footer(
      "With the options your run uses, this prints exactly the samples the model sees on that\n"
      "rank at that step: text detokenized with token boundaries marked (| or alternating\n"
      "shades), images as terminal art with their label, other fields as values.\n"
      "--interactive: the same full-screen, stepping through steps and ranks with the keys.\n"
      "`loom data serve` shows it in a browser.\n"
      "A run directory in place of the dataset takes the dataset and every reader option from\n"
      "the run (what its program opened through Runtime::open_dataset or open_mixture, in\n"
      "readers.json) and starts at the step its newest checkpoint resumes at:\n"
      "  loom data show runs/gpt --rank 1     # what rank 1 reads next when the run resumes");
  s->callback([show, &action] { action = [show] { return run_show(*show); }; });
}

}  // namespace loom::cli
