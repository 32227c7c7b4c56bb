// `loom data build text|fashion-mnist|jsonl|images|webdataset`: turns source data into a Loom
// dataset (docs/data-format.md). Text is tokenized with SentencePiece (a BPE model trained here,
// or a given one); Fashion-MNIST IDX files, JSONL (plain, multimodal or episodes), a folder of
// images per class and WebDataset tar files become record datasets.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "data_commands.h"
#include "idx.h"
#include "loom/data/dataset.h"
#include "loom/data/registry.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "progress.h"
#include "tar_reader.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/subprocess.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

void print_summary(const data::Manifest& m, const fs::path& out) {
  std::cout << "built " << out.string() << ": " << m.total_items()
            << (m.kind == data::DatasetKind::kTokens ? " tokens in " : " records in ")
            << (m.kind == data::DatasetKind::kTokens
                    ? std::to_string(m.total_documents()) + " documents, "
                    : "")
            << m.shards.size() << " shard" << (m.shards.size() == 1 ? "" : "s") << ", "
            << m.total_bytes() << " bytes; version " << m.version << "\n";
}

// The command line a build was run with, words quoted for a shell where they need it.
std::string command_line(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) {
    const bool plain = !w.empty() && w.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLM"
                                         "NOPQRSTUVWXYZ0123456789-_./=:@,+") == std::string::npos;
    std::string quoted = "'";
    for (char c : w) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += (out.empty() ? "" : " ") + (plain ? w : quoted + "'");
  }
  return out;
}

// Lineage of an input file: its absolute path (or "-" for stdin), size and hash.
data::SourceFile source_of(const std::string& name, const std::string& bytes) {
  return {name == "-" ? "-" : fs::absolute(name).lexically_normal().string(), bytes.size(),
          util::xxh64(bytes)};
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// "a, b, c".
std::string joined(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : ", ") + w;
  return out;
}

// writer.add(record), with an InvalidArgument from it (an image that does not decode, a layout
// rule broken) prefixed by `source`, where the record came from.
void add_record(data::RecordDatasetWriter& writer, const data::Record& record,
                const std::string& source) {
  try {
    writer.add(record);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(source + ": " + e.what());
  }
}

// ---- text ----

constexpr int kSpmThreads = 16;  // spm_train's threads: fixed, since the model records them

struct TextArgs {
  std::vector<std::string> inputs;
  std::string out;
  int vocab_size = 8000;
  std::string tokenizer;
  std::string docs = "paragraph";
  uint64_t shard_tokens = 64ull << 20;
};

std::string read_input(const std::string& name) {
  if (name == "-") {
    std::ostringstream s;
    s << std::cin.rdbuf();
    return s.str();
  }
  std::ifstream in(name, std::ios::binary);
  LOOM_CHECK(in.good(), InvalidArgument, "cannot read input file ", name);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Documents: paragraphs separated by blank lines, or one per line.
std::vector<std::string> split_documents(const std::string& text, bool per_line) {
  std::vector<std::string> docs;
  std::string current;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const bool blank = line.find_first_not_of(" \t\r") == std::string::npos;
    if (per_line || blank) {
      if (per_line && !blank) current = line;
      if (!current.empty()) docs.push_back(std::move(current));
      current.clear();
      continue;
    }
    current += (current.empty() ? "" : "\n") + line;
  }
  if (!current.empty()) docs.push_back(std::move(current));
  return docs;
}

// Runs a SentencePiece tool (Debian's `sentencepiece` package) with its output in `log`.
// SentencePiece runs in its own process: its library carries a protobuf runtime that clashes
// with the one libtorch loads, so it cannot share a process with Loom.
void run_spm(const std::vector<std::string>& argv, const fs::path& log,
             std::optional<fs::path> cwd = std::nullopt) {
  util::ExitStatus status;
  try {
    status = util::Subprocess::spawn({.argv = argv, .output = log, .cwd = std::move(cwd)}).wait();
  } catch (const IoError& e) {
    throw InvalidArgument(detail::concat("cannot run ", argv[0],
                                         " (install Debian's sentencepiece package): ", e.what()));
  }
  LOOM_CHECK(status.ok(), InvalidArgument, argv[0], " ", status.describe(), "; see ", log.string());
}

// The ids of every line of `corpus`, one vector per line, through spm_encode.
std::vector<std::vector<uint32_t>> encode_lines(const fs::path& corpus, const fs::path& out) {
  const fs::path ids_file = out / "tokenizer.ids.tmp";
  run_spm({"spm_encode", "--model=" + (out / "tokenizer.model").string(), "--output_format=id",
           "--input=" + corpus.string(), "--output=" + ids_file.string()},
          out / "tokenizer.log");
  std::vector<std::vector<uint32_t>> lines;
  std::ifstream in(ids_file);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    auto& ids = lines.emplace_back();
    for (uint32_t id; words >> id;) ids.push_back(id);
  }
  fs::remove(ids_file);
  return lines;
}

int build_text(const TextArgs& args) {
  const fs::path out = args.out;
  LOOM_CHECK(!fs::exists(out / "manifest.json"), InvalidArgument, out.string(),
             " already holds a dataset; remove it or choose another --out");
  std::string text;
  data::Lineage lineage;
  std::vector<std::string> words = {"loom", "data", "build", "text", "--input"};
  for (const std::string& input : args.inputs) {
    const std::string bytes = read_input(input);
    lineage.sources.push_back(source_of(input, bytes));
    words.push_back(input);
    text += bytes + "\n\n";
  }
  for (const std::string& w : {std::string("--out"), args.out, std::string("--docs"), args.docs,
                               std::string("--shard-tokens"), std::to_string(args.shard_tokens)})
    words.push_back(w);
  if (args.tokenizer.empty()) {
    words.insert(words.end(), {"--vocab-size", std::to_string(args.vocab_size)});
  } else {
    words.insert(words.end(), {"--tokenizer", args.tokenizer});
  }
  lineage.command = command_line(words);
  const std::vector<std::string> docs = split_documents(text, args.docs == "line");
  LOOM_CHECK(!docs.empty(), InvalidArgument, "the input holds no text");
  fs::create_directories(out);

  // The corpus: every line of every document, and how many lines each document has.
  const fs::path corpus = out / "tokenizer.corpus.tmp";
  std::vector<size_t> doc_lines;
  {
    std::ofstream f(corpus, std::ios::binary);
    for (const std::string& d : docs) {
      f << d << "\n";
      doc_lines.push_back(static_cast<size_t>(std::count(d.begin(), d.end(), '\n')) + 1);
    }
    LOOM_CHECK(f.good(), IoError, "cannot write ", corpus.string());
  }
  const fs::path log = out / "tokenizer.log";
  if (args.tokenizer.empty()) {
    std::cerr << "training a BPE tokenizer of " << args.vocab_size << " pieces on " << docs.size()
              << " documents (log: " << log.string() << ")\n";
    // spm_train writes its options into the model (the input and output paths, the thread
    // count), and the model is part of the content version: so it runs in the output
    // directory with relative paths and a fixed thread count, and the same input gives the
    // same model, wherever it is built and on any machine.
    run_spm({"spm_train", "--input=" + corpus.filename().string(), "--model_prefix=tokenizer",
             "--vocab_size=" + std::to_string(args.vocab_size), "--model_type=bpe",
             "--character_coverage=1.0", "--unk_id=0", "--eos_id=1", "--bos_id=-1", "--pad_id=-1",
             "--num_threads=" + std::to_string(kSpmThreads)},
            log, fs::absolute(out));
    fs::remove(out / "tokenizer.vocab");
  } else {
    fs::copy_file(args.tokenizer, out / "tokenizer.model", fs::copy_options::overwrite_existing);
  }
  run_spm({"spm_export_vocab", "--model=" + (out / "tokenizer.model").string(),
           "--output=" + (out / "tokenizer.vocab").string()},
          log);
  const data::Vocabulary vocab = data::Vocabulary::load(out / "tokenizer.vocab");
  const uint64_t model_hash = util::xxh64(util::read_file(out / "tokenizer.model"));
  lineage.tokenizer =
      (args.tokenizer.empty()
           ? "trained here: spm_train BPE, " + std::to_string(args.vocab_size) + " pieces"
           : "copied from " + fs::absolute(args.tokenizer).lexically_normal().string()) +
      "; tokenizer.model xxHash64 " + util::hash_hex(model_hash);

  std::cerr << "tokenizing " << docs.size() << " documents\n";
  const std::vector<std::vector<uint32_t>> lines = encode_lines(corpus, out);
  fs::remove(corpus);
  std::string description = "text:";
  for (const auto& input : args.inputs) description += " " + fs::path(input).filename().string();
  description += "; SentencePiece BPE, " + std::to_string(vocab.size()) + " pieces";
  data::TokenDatasetWriter writer(out, {.vocab_size = vocab.size(),
                                        .eos_id = vocab.id_of("</s>"),
                                        .tokens_per_shard = args.shard_tokens,
                                        .tokenizer = "tokenizer.vocab",
                                        .tokenizer_files = {"tokenizer.model", "tokenizer.vocab"},
                                        .description = description});
  data::write_build_lineage(out, lineage);
  Progress progress("writing", docs.size(), "documents");
  std::vector<uint32_t> tokens;
  size_t line = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    tokens.clear();
    for (size_t k = 0; k < doc_lines[d]; ++k, ++line) {
      LOOM_CHECK(line < lines.size(), Error, "spm_encode returned ", lines.size(), " lines for ",
                 line + 1);
      tokens.insert(tokens.end(), lines[line].begin(), lines[line].end());
    }
    writer.add_document(tokens);
    progress.update(d + 1);
  }
  progress.finish(docs.size());
  print_summary(writer.finish(), out);
  return kExitOk;
}

// ---- fashion-mnist ----

struct FashionArgs {
  std::string split = "train";
  std::string dir = "/usr/share/datasets/fashion-mnist";
  std::string images, labels;
  std::string out;
};

int build_fashion_mnist(const FashionArgs& args) {
  LOOM_CHECK(args.split == "train" || args.split == "test", InvalidArgument,
             "--split must be train or test, got ", args.split);
  const std::string prefix = args.split == "train" ? "train" : "t10k";
  const fs::path images_path = args.images.empty()
                                   ? fs::path(args.dir) / (prefix + "-images-idx3-ubyte.gz")
                                   : fs::path(args.images);
  const fs::path labels_path = args.labels.empty()
                                   ? fs::path(args.dir) / (prefix + "-labels-idx1-ubyte.gz")
                                   : fs::path(args.labels);
  const IdxArray images = read_idx(images_path, 3);
  const IdxArray labels = read_idx(labels_path, 1);
  LOOM_CHECK(images.shape[0] == labels.shape[0], CorruptData, images_path.string(), " holds ",
             images.shape[0], " images but ", labels_path.string(), " holds ", labels.shape[0],
             " labels");
  const int64_t n = images.shape[0], h = images.shape[1], w = images.shape[2];
  data::RecordDatasetWriter writer(
      args.out,
      {{"image", data::FieldType::kTensor, "uint8", {h, w}},
       {"label",
        data::FieldType::kInt,
        "",
        {},
        {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
         "Ankle boot"}}},
      {.description = "Fashion-MNIST " + args.split + ": " + images_path.filename().string() +
                      ", " + labels_path.filename().string()});
  data::Lineage lineage;
  lineage.command =
      command_line({"loom", "data", "build", "fashion-mnist", "--out", args.out, "--images",
                    images_path.string(), "--labels", labels_path.string()});
  lineage.sources = {data::describe_source(images_path), data::describe_source(labels_path)};
  data::write_build_lineage(args.out, lineage);
  Progress progress("writing records", static_cast<uint64_t>(n), "images");
  const size_t pixels = static_cast<size_t>(h * w);
  for (int64_t i = 0; i < n; ++i) {
    writer.add(data::Record()
                   .tensor(images.data.data() + static_cast<size_t>(i) * pixels, pixels, {h, w})
                   .integer(labels.data[static_cast<size_t>(i)]));
    progress.update(static_cast<uint64_t>(i + 1));
  }
  progress.finish(static_cast<uint64_t>(n));
  print_summary(writer.finish(), args.out);
  return kExitOk;
}

// ---- jsonl ----

struct JsonlArgs {
  std::string input;
  std::string out;
  std::string layout = "plain";
};

// The shape of a nested array of numbers, or nullopt; sets `integral` when all are integers.
bool array_shape(const json& value, std::vector<int64_t>& shape, bool& integral, size_t depth = 0) {
  if (value.is_number()) {
    integral = integral && value.is_number_integer();
    return depth == shape.size();
  }
  if (!value.is_array() || value.empty()) return false;
  if (depth == shape.size()) shape.push_back(static_cast<int64_t>(value.size()));
  if (shape[depth] != static_cast<int64_t>(value.size())) return false;
  for (const json& v : value) {
    if (!array_shape(v, shape, integral, depth + 1)) return false;
  }
  return true;
}

// False when `value` (or an element of it) is an integer above INT64_MAX: nlohmann keeps those
// as uint64, and storing one as int64 would wrap it silently into a negative number.
bool fits_int64(const json& value) {
  if (value.is_array()) {
    for (const json& v : value) {
      if (!fits_int64(v)) return false;
    }
    return true;
  }
  return !value.is_number_unsigned() ||
         value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

template <typename T>
void flatten(const json& value, std::vector<T>& out) {
  if (value.is_array()) {
    for (const json& v : value) flatten(v, out);
  } else {
    out.push_back(value.get<T>());
  }
}

data::Field infer_field(const std::string& name, const json& value) {
  if (value.is_string()) return {name, data::FieldType::kText};
  if (value.is_boolean() || value.is_number_integer()) return {name, data::FieldType::kInt};
  if (value.is_number_float()) return {name, data::FieldType::kFloat};
  std::vector<int64_t> shape;
  bool integral = true;
  if (array_shape(value, shape, integral))
    return {name, data::FieldType::kTensor, integral ? "int64" : "float32"};
  return {name, data::FieldType::kBytes};  // objects, null, ragged arrays: their JSON text
}

data::Field ragged_field(const std::string& name, std::string dtype) {
  data::Field f{name, data::FieldType::kTensor, std::move(dtype)};
  f.ragged = true;
  return f;
}

// The keys a layout needs on every line.
std::vector<std::string> required_keys(data::RecordLayout layout) {
  switch (layout) {
    case data::RecordLayout::kEpisodes:
      return {"observation", "action", "reward", "done"};
    case data::RecordLayout::kMultimodal:
      return {"tokens", "images", "image_positions"};
    case data::RecordLayout::kPlain:
      break;
  }
  return {};
}

// What a layout's one-dimensional keys must hold, or nullptr for other keys: the numbers of
// an episode's steps, a multimodal sequence's token ids and image positions.
const char* flat_key(data::RecordLayout layout, const std::string& name) {
  if (layout == data::RecordLayout::kEpisodes) {
    if (name == "done") return "an array of true/false or 0/1, one per step";
    if (name == "reward" || name == "log_prob" || name == "value") {
      return "an array of numbers, one per step";
    }
  } else if (layout == data::RecordLayout::kMultimodal) {
    if (name == "tokens" || name == "image_positions") return "an array of integers";
  }
  return nullptr;
}

// The field a key of the first line becomes: the layout's keys by their role, others by their
// value (infer_field).
data::Field jsonl_field(data::RecordLayout layout, const std::string& name, const json& value) {
  if (layout == data::RecordLayout::kEpisodes) {
    if (name == "done") return ragged_field(name, "uint8");
    if (name == "reward" || name == "log_prob" || name == "value") {
      return ragged_field(name, "float32");
    }
    if (name == "observation" || name == "action") {
      return ragged_field(name, infer_field(name, value).dtype == "int64" ? "int64" : "float32");
    }
  } else if (layout == data::RecordLayout::kMultimodal) {
    if (name == "tokens" || name == "image_positions") return ragged_field(name, "int64");
    if (name == "images") return {name, data::FieldType::kImages};
  }
  return infer_field(name, value);
}

// A tensor field's value: a nested array of numbers (a ragged field may also be []), or for
// episodes' "done" an array of true/false or 0/1; `flat` (flat_key) when it must be 1-D. Returns
// what `v` must be when it is not that.
std::string add_tensor(data::Record& record, const data::Field& field, const json& v,
                       const char* flat) {
  if (field.dtype == "uint8") {  // the only uint8 field: episodes' "done"
    std::vector<uint8_t> done;
    if (!v.is_array()) return flat;
    for (const json& d : v) {
      if (!d.is_boolean() && d != 0 && d != 1) return flat;
      done.push_back(d.is_boolean() ? d.get<bool>() : d.get<uint8_t>());
    }
    record.tensor(done.data(), done.size(), {static_cast<int64_t>(done.size())});
    return "";
  }
  std::vector<int64_t> shape;
  bool integral = true;
  const bool empty = field.ragged && v.is_array() && v.empty();
  if (empty) shape = {0};
  const bool int64 = field.dtype == "int64";
  if (!(empty || array_shape(v, shape, integral)) || (flat && shape.size() != 1) ||
      (int64 && !integral)) {
    return flat ? flat : std::string("a nested array of ") + (int64 ? "integers" : "numbers");
  }
  if (int64) {
    std::vector<int64_t> values;
    flatten(v, values);
    record.tensor(values.data(), values.size() * 8, shape);
  } else {
    std::vector<float> values;
    flatten(v, values);
    record.tensor(values.data(), values.size() * 4, shape);
  }
  return "";
}

// The bytes of an image file that line `at` names.
using ReadImageFn = std::function<std::string(const std::string& at, const std::string& name)>;

// Appends `v`, line `at`'s value of `field`, to `record`: InvalidArgument naming the line and the
// key when it does not fit. `flat`: flat_key's for the key.
void add_json_value(data::Record& record, const data::Field& field, const json& v,
                    const std::string& at, const char* flat, const ReadImageFn& read_image) {
  std::string want;
  switch (field.type) {
    case data::FieldType::kImage:
      throw std::logic_error("jsonl_field never makes an image field");
    case data::FieldType::kText:
      if (!v.is_string()) want = "a string";
      break;
    case data::FieldType::kInt:
      if (!v.is_boolean() && !v.is_number_integer()) want = "an integer or a boolean";
      break;
    case data::FieldType::kFloat:
      if (!v.is_number()) want = "a number";
      break;
    case data::FieldType::kImages:
      if (!v.is_array() ||
          !std::all_of(v.begin(), v.end(), [](const json& p) { return p.is_string(); })) {
        want = "an array of image file paths";
      }
      break;
    case data::FieldType::kBytes:
    case data::FieldType::kTensor:
      break;
  }
  LOOM_CHECK(want.empty(), InvalidArgument, at, ": key \"", field.name, "\" is ", v.type_name(),
             "; it must be ", want);
  const bool integral = field.type == data::FieldType::kInt || field.dtype == "int64";
  LOOM_CHECK(!integral || fits_int64(v), InvalidArgument, at, ": key \"", field.name,
             "\" holds an integer beyond int64's range (at most ",
             std::numeric_limits<int64_t>::max(), "); store it as a string or a float");
  switch (field.type) {
    case data::FieldType::kImage:
      break;
    case data::FieldType::kImages: {
      std::vector<std::string> images;
      for (const json& path : v) images.push_back(read_image(at, path.get<std::string>()));
      record.images(std::move(images));
      break;
    }
    case data::FieldType::kText:
      record.text(v.get<std::string>());
      break;
    case data::FieldType::kInt:
      record.integer(v.is_boolean() ? v.get<bool>() : v.get<int64_t>());
      break;
    case data::FieldType::kFloat:
      record.real(v.get<double>());
      break;
    case data::FieldType::kBytes:
      record.bytes(v.dump());
      break;
    case data::FieldType::kTensor:
      want = add_tensor(record, field, v, flat);
      LOOM_CHECK(want.empty(), InvalidArgument, at, ": key \"", field.name, "\" is ", v.type_name(),
                 "; it must be ", want);
      break;
  }
}

data::RecordLayout parse_layout(const std::string& name) {
  for (auto layout : {data::RecordLayout::kPlain, data::RecordLayout::kMultimodal,
                      data::RecordLayout::kEpisodes}) {
    if (name == data::to_string(layout)) return layout;
  }
  throw InvalidArgument("--layout must be plain, multimodal or episodes, got " + name);
}

int build_jsonl(const JsonlArgs& args) {
  const data::RecordLayout layout = parse_layout(args.layout);
  std::ifstream in(args.input);
  LOOM_CHECK(in.good(), InvalidArgument, "cannot read input file ", args.input);
  std::vector<std::pair<size_t, std::string>> lines;  // the non-blank lines and their numbers
  size_t number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (line.find_first_not_of(" \t\r") != std::string::npos) lines.emplace_back(number, line);
  }
  LOOM_CHECK(!lines.empty(), InvalidArgument, args.input, " holds no JSON lines");
  auto where = [&](size_t i) { return args.input + ":" + std::to_string(lines[i].first); };
  auto parse = [&](size_t i) {
    try {
      json j = json::parse(lines[i].second);
      LOOM_CHECK(j.is_object(), InvalidArgument, where(i), ": a line must be a JSON object");
      return j;
    } catch (const json::parse_error& e) {
      throw InvalidArgument(detail::concat(where(i), ": not valid JSON: ", e.what()));
    }
  };
  const json first = parse(0);
  const std::vector<std::string> required = required_keys(layout);
  for (const std::string& key : required) {
    LOOM_CHECK(first.contains(key), InvalidArgument, where(0), ": the ", args.layout,
               " layout needs the keys ", joined(required), "; this line has no \"", key, "\"");
  }
  std::vector<data::Field> schema;
  for (const auto& [key, value] : first.items()) schema.push_back(jsonl_field(layout, key, value));

  data::RecordDatasetWriter writer(
      args.out, schema,
      {.description = "jsonl: " + fs::path(args.input).filename().string(), .layout = layout});
  std::vector<std::string> words = {"loom", "data", "build", "jsonl", "--input", args.input};
  if (layout != data::RecordLayout::kPlain) words.insert(words.end(), {"--layout", args.layout});
  words.insert(words.end(), {"--out", args.out});
  data::Lineage lineage{.sources = {data::describe_source(args.input)},
                        .command = command_line(words)};
  // Image files, relative to the JSONL file's folder; each is a source of the lineage once.
  const fs::path folder = fs::path(args.input).parent_path();
  std::set<std::string> images_read;
  auto read_image = [&](const std::string& at, const std::string& name) {
    const fs::path path = (folder / name).lexically_normal();
    LOOM_CHECK(fs::is_regular_file(path), InvalidArgument, at, ": key \"images\" names ", name,
               ", but ", path.string(), " is not a file");
    std::string bytes = util::read_file(path);
    if (images_read.insert(path.string()).second) {
      lineage.sources.push_back(source_of(path.string(), bytes));
    }
    return bytes;
  };
  Progress progress("writing records", lines.size(), "lines");
  for (size_t i = 0; i < lines.size(); ++i) {
    const json j = parse(i);
    const std::string at = where(i);
    LOOM_CHECK(j.size() == schema.size(), InvalidArgument, at, ": has ", j.size(),
               " keys; the first line has ", schema.size());
    data::Record record;
    for (const data::Field& field : schema) {
      LOOM_CHECK(j.contains(field.name), InvalidArgument, at, ": no key \"", field.name, "\"");
      add_json_value(record, field, j.at(field.name), at, flat_key(layout, field.name), read_image);
    }
    add_record(writer, record, at);
    progress.update(i + 1);
  }
  progress.finish(lines.size());
  data::write_build_lineage(args.out, lineage);
  print_summary(writer.finish(), args.out);
  return kExitOk;
}

// ---- images ----

struct ImagesArgs {
  std::string dir;
  std::string out;
};

int build_images(const ImagesArgs& args) {
  const fs::path root = args.dir;
  const std::string expected =
      "expected " + (root / "<class>/<image>").string() + ".png, .jpg or .jpeg, a folder per class";
  LOOM_CHECK(fs::is_directory(root), InvalidArgument, args.dir, " is not a directory; ", expected);
  std::vector<std::string> classes;
  for (const auto& entry : fs::directory_iterator(root)) {
    LOOM_CHECK(entry.is_directory(), InvalidArgument, entry.path().string(),
               " is not in a class folder; ", expected);
    classes.push_back(entry.path().filename().string());
  }
  std::sort(classes.begin(), classes.end());
  std::vector<std::pair<int64_t, fs::path>> images;  // label, path relative to root
  for (size_t label = 0; label < classes.size(); ++label) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::recursive_directory_iterator(
             root / classes[label], fs::directory_options::follow_directory_symlink)) {
      if (entry.is_directory()) continue;
      const std::string ext = lower(entry.path().extension().string());
      LOOM_CHECK(ext == ".png" || ext == ".jpg" || ext == ".jpeg", InvalidArgument,
                 entry.path().string(), " is not a .png, .jpg or .jpeg file; ", expected);
      files.push_back(entry.path().lexically_relative(root));
    }
    std::sort(files.begin(), files.end());
    for (fs::path& f : files) images.emplace_back(label, std::move(f));
  }
  LOOM_CHECK(!images.empty(), InvalidArgument, args.dir, " holds no images; ", expected);

  data::RecordDatasetWriter writer(
      args.out,
      {{"image", data::FieldType::kImage},
       {"label", data::FieldType::kInt, "", {}, classes},
       {"path", data::FieldType::kText}},
      {.description = "images: " + fs::canonical(root).filename().string() + ", " +
                      std::to_string(classes.size()) + " classes"});
  data::Lineage lineage{
      .command = command_line({"loom", "data", "build", "images", args.dir, "--out", args.out})};
  Progress progress("writing records", images.size(), "images");
  for (size_t i = 0; i < images.size(); ++i) {
    const auto& [label, relative] = images[i];
    const std::string path = (root / relative).string();
    std::string bytes = util::read_file(path);
    lineage.sources.push_back(source_of(path, bytes));
    add_record(
        writer,
        data::Record().image(std::move(bytes)).integer(label).text(relative.generic_string()),
        path);
    progress.update(i + 1);
  }
  progress.finish(images.size());
  data::write_build_lineage(args.out, lineage);
  print_summary(writer.finish(), args.out);
  return kExitOk;
}

// ---- webdataset ----

struct WebDatasetArgs {
  std::vector<std::string> inputs;
  std::string out;
};

// A member path's WebDataset key and extension: "d/0001.seg.png" is sample "d/0001", "seg.png".
std::pair<std::string, std::string> split_member(const std::string& tar, const std::string& path) {
  const size_t slash = path.rfind('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = path.find('.', base);
  LOOM_CHECK(dot != std::string::npos && dot > base && dot + 1 < path.size(), InvalidArgument, tar,
             ": member '", path,
             "' is not named KEY.EXTENSION, as WebDataset members are (d/0001.jpg)");
  return {path.substr(0, dot), path.substr(dot + 1)};
}

// The last part of an extension, lower case: what decides its field's type ("seg.PNG": "png").
std::string extension_kind(const std::string& extension) {
  return lower(extension.substr(extension.rfind('.') + 1));
}

data::Field webdataset_field(const std::string& extension) {
  const std::string kind = extension_kind(extension);
  if (kind == "jpg" || kind == "jpeg" || kind == "png") return {extension, data::FieldType::kImage};
  if (kind == "cls") return {extension, data::FieldType::kInt};
  if (kind == "txt" || kind == "json") return {extension, data::FieldType::kText};
  return {extension, data::FieldType::kBytes};
}

// `text` as a decimal integer, between optional white space; nullopt otherwise.
std::optional<int64_t> parse_integer(std::string_view text) {
  const size_t begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string_view::npos) return std::nullopt;
  text = text.substr(begin, text.find_last_not_of(" \t\r\n") + 1 - begin);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// InvalidArgument "`what` is not valid JSON: ..." unless `text` parses.
void check_json(const std::string& text, const std::string& what) {
  try {
    const json parsed = json::parse(text);
  } catch (const json::parse_error& e) {
    throw InvalidArgument(what + " is not valid JSON: " + e.what());
  }
}

// One sample: consecutive members with the same key, their data by extension.
struct Sample {
  std::string key;
  std::map<std::string, std::string> members;
};

// Adds `sample` of tar file `tar` as a record of `schema` (a field per extension).
void add_sample(data::RecordDatasetWriter& writer, const std::vector<data::Field>& schema,
                const std::string& tar, Sample& sample) {
  std::vector<std::string> needed, has, missing, extra;
  for (const data::Field& f : schema) {
    needed.push_back(f.name);
    if (!sample.members.count(f.name)) missing.push_back(f.name);
  }
  for (const auto& member : sample.members) {
    has.push_back(member.first);
    if (!std::binary_search(needed.begin(), needed.end(), member.first))
      extra.push_back(member.first);
  }
  if (!missing.empty() || !extra.empty()) {
    const std::string but = missing.empty() ? " but" : ", and";
    throw InvalidArgument(
        detail::concat(tar, ": sample '", sample.key, "' has ", joined(has),
                       missing.empty() ? "" : " but no " + joined(missing),
                       extra.empty() ? "" : but + " the first sample has no " + joined(extra),
                       "; every sample needs the members of the first: ", joined(needed)));
  }
  data::Record record;
  std::vector<std::string> images;  // its image members
  for (const data::Field& f : schema) {
    std::string& bytes = sample.members.at(f.name);
    const std::string member = sample.key + "." + f.name;
    if (f.type == data::FieldType::kImage) {
      images.push_back(member);
      record.image(std::move(bytes));
    } else if (f.type == data::FieldType::kInt) {
      const std::optional<int64_t> value = parse_integer(bytes);
      LOOM_CHECK(value, InvalidArgument, tar, ": member '", member,
                 "' is not an integer; a .cls member holds a class number in decimal");
      record.integer(*value);
    } else if (f.type == data::FieldType::kText) {
      if (extension_kind(f.name) == "json") check_json(bytes, tar + ": member '" + member + "'");
      record.text(std::move(bytes));
    } else {
      record.bytes(std::move(bytes));
    }
  }
  // The writer decodes every image: name the member when there is one.
  add_record(writer, record,
             tar + ": " +
                 (images.size() == 1 ? "member '" + images[0] + "'"
                                     : "sample '" + sample.key + "' (" + joined(images) + ")"));
}

int build_webdataset(const WebDatasetArgs& args) {
  uint64_t total = 0;
  std::string names;
  std::vector<std::string> words = {"loom", "data", "build", "webdataset"};
  for (const std::string& input : args.inputs) {
    std::error_code ec;
    const uint64_t size = fs::file_size(input, ec);
    LOOM_CHECK(!ec, InvalidArgument, "cannot read tar file ", input, ": ", ec.message());
    total += size;
    names += (names.empty() ? "" : ", ") + fs::path(input).filename().string();
    words.insert(words.end(), {"--input", input});
  }
  words.insert(words.end(), {"--out", args.out});
  data::Lineage lineage{.command = command_line(words)};
  std::vector<data::Field> schema;  // the first sample's extensions, sorted
  std::optional<data::RecordDatasetWriter> writer;
  Progress progress("reading tar files", total, "bytes");
  uint64_t done = 0;
  for (const std::string& input : args.inputs) {
    TarReader tar(input);
    Sample sample;
    auto flush = [&] {
      if (sample.members.empty()) return;
      if (!writer) {
        for (const auto& member : sample.members) schema.push_back(webdataset_field(member.first));
        writer.emplace(args.out, schema,
                       data::RecordWriterOptions{.description = "webdataset: " + names});
      }
      add_sample(*writer, schema, input, sample);
      progress.update(done + tar.offset());
    };
    for (TarMember member; tar.next(&member);) {
      auto [key, extension] = split_member(input, member.path);
      if (key != sample.key) {
        flush();
        sample = {std::move(key), {}};
      }
      LOOM_CHECK(sample.members.emplace(extension, std::move(member.data)).second, InvalidArgument,
                 input, ": member '", member.path, "' appears twice in sample '", sample.key, "'");
    }
    flush();
    done += tar.size();
    lineage.sources.push_back(
        {fs::absolute(input).lexically_normal().string(), tar.size(), tar.xxhash64()});
  }
  LOOM_CHECK(writer, InvalidArgument, "the tar files hold no members: ", names);
  progress.finish(done);
  data::write_build_lineage(args.out, lineage);
  print_summary(writer->finish(), args.out);
  return kExitOk;
}

}  // namespace

void register_data_build(CLI::App& data, Action& action) {
  CLI::App* build = data.add_subcommand(
      "build", "Build a dataset from text, Fashion-MNIST, JSONL, images or WebDataset tar files.");
  build->require_subcommand(1);
  build->footer(
      "Every build writes shards and then manifest.json, atomically; a directory without a\n"
      "manifest is an unfinished build. The dataset version printed at the end names the\n"
      "content: the same input gives the same version.");

  auto text = std::make_shared<TextArgs>();
  CLI::App* t =
      build->add_subcommand("text", "Tokenize text with SentencePiece into a token dataset.");
  t->add_option("--input", text->inputs, "text file(s); - reads stdin")->required();
  t->add_option("--out", text->out, "the dataset directory to create")->required();
  t->add_option("--vocab-size", text->vocab_size, "pieces of the BPE model trained on the input")
      ->capture_default_str()
      ->check(CLI::Range(64, 1 << 20));
  t->add_option("--tokenizer", text->tokenizer,
                "use this SentencePiece .model instead of training one")
      ->check(CLI::ExistingFile);
  t->add_option("--docs", text->docs,
                "what a document is: paragraph (blank-line separated) or line")
      ->capture_default_str()
      ->check(CLI::IsMember({"paragraph", "line"}));
  t->add_option("--shard-tokens", text->shard_tokens, "tokens per shard")->capture_default_str();
  t->footer(
      "Example (the King James Bible from Debian's bible-kjv):\n"
      "  bible gen1:1-rev22:21 > kjv.txt\n"
      "  loom data build text --input kjv.txt --vocab-size 4096 --out data/kjv-bpe\n"
      "Every document ends with the tokenizer's end-of-sequence id. Needs Debian's sentencepiece\n"
      "package (spm_train, spm_encode, spm_export_vocab); the dataset keeps tokenizer.model and\n"
      "tokenizer.vocab.");
  t->callback([text, &action] { action = [text] { return build_text(*text); }; });

  auto fashion = std::make_shared<FashionArgs>();
  CLI::App* f =
      build->add_subcommand("fashion-mnist", "Fashion-MNIST IDX files into a record dataset.");
  f->add_option("--out", fashion->out, "the dataset directory to create")->required();
  f->add_option("--split", fashion->split, "train (60000 images) or test (10000)")
      ->capture_default_str();
  f->add_option("--dir", fashion->dir, "where the IDX files are (Debian's dataset-fashion-mnist)")
      ->capture_default_str();
  f->add_option("--images", fashion->images, "the images IDX file (overrides --dir/--split)");
  f->add_option("--labels", fashion->labels, "the labels IDX file (overrides --dir/--split)");
  f->footer("Fields: image (uint8 tensor [28, 28]) and label (int, with the ten class names).");
  f->callback([fashion, &action] { action = [fashion] { return build_fashion_mnist(*fashion); }; });

  auto jsonl = std::make_shared<JsonlArgs>();
  CLI::App* j = build->add_subcommand("jsonl", "JSON lines into a record dataset.");
  j->add_option("--input", jsonl->input, "a file of one JSON object per line")->required();
  j->add_option("--out", jsonl->out, "the dataset directory to create")->required();
  j->add_option("--layout", jsonl->layout, "plain, multimodal or episodes (docs/data-format.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"plain", "multimodal", "episodes"}));
  j->footer(
      "Example (RL episodes, one per line):\n"
      "  loom data build jsonl --input episodes.jsonl --layout episodes --out data/episodes\n"
      "The first line sets the schema: strings become text fields, integers and booleans int,\n"
      "other numbers float, nested arrays of numbers tensors (int64 or float32, shape per\n"
      "record), anything else bytes holding its JSON text. Every line must have the same keys.\n"
      "--layout episodes: observation, action, reward, done (and log_prob, value) are arrays\n"
      "with one entry per step, stored as ragged tensors. --layout multimodal: tokens (ids),\n"
      "images (PNG or JPEG paths, relative to the JSONL file) and image_positions (the token\n"
      "each image comes before).");
  j->callback([jsonl, &action] { action = [jsonl] { return build_jsonl(*jsonl); }; });

  auto images = std::make_shared<ImagesArgs>();
  CLI::App* im = build->add_subcommand(
      "images", "A folder of PNG and JPEG images, a subfolder per class, into a record dataset.");
  im->add_option("dir", images->dir, "the folder: DIR/<class>/<image>.png|.jpg|.jpeg")->required();
  im->add_option("--out", images->out, "the dataset directory to create")->required();
  im->footer(
      "Example:\n"
      "  loom data build images photos --out data/photos\n"
      "Fields: image (the file's bytes as they are; decoded when read), label (int: the index of\n"
      "its class folder, classes sorted by name and listed in the manifest) and path (text,\n"
      "relative to DIR). Images are read in sorted path order; any other file is an error.");
  im->callback([images, &action] { action = [images] { return build_images(*images); }; });

  auto wds = std::make_shared<WebDatasetArgs>();
  CLI::App* w = build->add_subcommand("webdataset", "WebDataset tar files into a record dataset.");
  w->add_option("--input", wds->inputs, "tar file(s), read in the order given")->required();
  w->add_option("--out", wds->out, "the dataset directory to create")->required();
  w->footer(
      "Example:\n"
      "  loom data build webdataset --input shards/a.tar --input shards/b.tar --out data/train\n"
      "Consecutive members with the same key (the path up to the first '.' of the file name)\n"
      "form a sample, and each extension a field: jpg, jpeg and png an image, cls an int, txt\n"
      "and json text, anything else bytes. Every sample needs exactly the first's extensions.");
  w->callback([wds, &action] { action = [wds] { return build_webdataset(*wds); }; });
}

}  // namespace loom::cli
