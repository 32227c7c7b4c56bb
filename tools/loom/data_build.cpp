// `loom data build text|fashion-mnist|jsonl`: turns source data into a Loom dataset
// (docs/data-format.md). Text is tokenized with SentencePiece (a BPE model trained here, or a
// given one); Fashion-MNIST IDX files and JSONL become record datasets.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "data_commands.h"
#include "idx.h"
#include "loom/data/dataset.h"
#include "loom/data/registry.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "progress.h"
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

int build_jsonl(const JsonlArgs& args) {
  std::ifstream in(args.input);
  LOOM_CHECK(in.good(), InvalidArgument, "cannot read input file ", args.input);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) lines.push_back(std::move(line));
  }
  LOOM_CHECK(!lines.empty(), InvalidArgument, args.input, " holds no JSON lines");
  auto parse = [&](size_t i) {
    try {
      json j = json::parse(lines[i]);
      LOOM_CHECK(j.is_object(), InvalidArgument, args.input, ":", i + 1,
                 ": a line must be a JSON object");
      return j;
    } catch (const json::parse_error& e) {
      throw InvalidArgument(detail::concat(args.input, ":", i + 1, ": not valid JSON: ", e.what()));
    }
  };
  std::vector<data::Field> schema;
  const json first = parse(0);
  for (const auto& [key, value] : first.items()) schema.push_back(infer_field(key, value));

  data::RecordDatasetWriter writer(
      args.out, schema, {.description = "jsonl: " + fs::path(args.input).filename().string()});
  data::write_build_lineage(
      args.out, {.sources = {data::describe_source(args.input)},
                 .command = command_line({"loom", "data", "build", "jsonl", "--input", args.input,
                                          "--out", args.out})});
  Progress progress("writing records", lines.size(), "lines");
  for (size_t i = 0; i < lines.size(); ++i) {
    const json j = parse(i);
    LOOM_CHECK(j.size() == schema.size(), InvalidArgument, args.input, ":", i + 1, ": has ",
               j.size(), " keys; the first line has ", schema.size());
    data::Record record;
    for (const data::Field& field : schema) {
      LOOM_CHECK(j.contains(field.name), InvalidArgument, args.input, ":", i + 1, ": no key \"",
                 field.name, "\"");
      const json& v = j.at(field.name);
      const data::Field seen = infer_field(field.name, v);
      const bool compatible = seen.type == field.type ||
                              (field.type == data::FieldType::kFloat && v.is_number()) ||
                              field.type == data::FieldType::kBytes;
      LOOM_CHECK(
          compatible &&
              (field.type != data::FieldType::kTensor || seen.type == data::FieldType::kTensor),
          InvalidArgument, args.input, ":", i + 1, ": key \"", field.name, "\" is ", v.type_name(),
          "; the first line makes it a ", field.dtype.empty() ? "" : field.dtype + " ", "field");
      const bool integral = field.type == data::FieldType::kInt || field.dtype == "int64";
      LOOM_CHECK(!integral || fits_int64(v), InvalidArgument, args.input, ":", i + 1, ": key \"",
                 field.name, "\" holds an integer beyond int64's range (at most ",
                 std::numeric_limits<int64_t>::max(), "); store it as a string or a float");
      switch (field.type) {
        case data::FieldType::kImage:
        case data::FieldType::kImages:
          throw std::logic_error("infer_field never makes an image field");
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
        case data::FieldType::kTensor: {
          std::vector<int64_t> shape;
          bool integral = true;
          array_shape(v, shape, integral);
          if (field.dtype == "int64") {
            std::vector<int64_t> values;
            flatten(v, values);
            record.tensor(values.data(), values.size() * 8, shape);
          } else {
            std::vector<float> values;
            flatten(v, values);
            record.tensor(values.data(), values.size() * 4, shape);
          }
          break;
        }
      }
    }
    writer.add(record);
    progress.update(i + 1);
  }
  progress.finish(lines.size());
  print_summary(writer.finish(), args.out);
  return kExitOk;
}

}  // namespace

void register_data_build(CLI::App& data, Action& action) {
  CLI::App* build =
      data.add_subcommand("build", "Build a dataset from text, Fashion-MNIST or JSONL.");
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
  j->footer(
      "The first line sets the schema: strings become text fields, integers and booleans int,\n"
      "other numbers float, nested arrays of numbers tensors (int64 or float32, shape per\n"
      "record), anything else bytes holding its JSON text. Every line must have the same keys.");
  j->callback([jsonl, &action] { action = [jsonl] { return build_jsonl(*jsonl); }; });
}

}  // namespace loom::cli
