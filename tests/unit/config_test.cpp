// Tests for loom::Config and loom::ConfigSchema: the four layers and their precedence, every
// error message, --help, positional arguments and the TOML/JSON renderings.

#include "loom/config.h"
#include "harness/harness.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace loom {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A fresh directory removed with its contents on destruction. (Local rather than the
// harness's TempDir so that this test depends on nothing but the config sources.)
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "loom-config-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  // Writes `text` to a file named `name` in the directory and returns its path.
  fs::path write(const std::string& name, const std::string& text) const {
    const fs::path path = path_ / name;
    std::ofstream(path) << text;
    return path;
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Sets an environment variable for the scope and restores the previous state afterwards.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    ::setenv(name_.c_str(), value.c_str(), /*overwrite=*/1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

ConfigSchema test_schema() {
  ConfigSchema schema;
  schema.add("train.lr", 3e-4, "learning rate")
      .add("train.steps", 100, "optimizer steps")
      .add("train.verbose", false, "log every step")
      .add("train.optimizer", "adam", "adam or sgd")
      .add("data.path", std::string("/data"), "dataset directory")
      .add("seed", int64_t{7}, "random seed");
  return schema;
}

// Runs from_args over {"train", args...}.
Config parse_args(const ConfigSchema& schema, std::vector<std::string> args) {
  args.insert(args.begin(), "/usr/bin/train");
  std::vector<const char*> argv;
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  return Config::from_args(schema, static_cast<int>(argv.size()), argv.data());
}

using testing::error_of;

Config load_file(const ConfigSchema& schema, const fs::path& file) {
  ConfigSources sources;
  sources.file = file;
  sources.read_env = false;
  return Config::load(schema, sources);
}

// ----- Layers ----------------------------------------------------------------------------------

TEST(Config, DefaultsAreTheDeclaredValues) {
  const Config config = Config::defaults(test_schema());
  EXPECT_DOUBLE_EQ(config.get<double>("train.lr"), 3e-4);
  EXPECT_EQ(config.get<int>("train.steps"), 100);
  EXPECT_EQ(config.get<int64_t>("seed"), 7);
  EXPECT_FALSE(config.get<bool>("train.verbose"));
  EXPECT_EQ(config.get<std::string>("train.optimizer"), "adam");
  EXPECT_EQ(config.get<std::string>("data.path"), "/data");
  EXPECT_EQ(config.source("train.lr"), ConfigSource::kDefault);
  EXPECT_FALSE(config.file().has_value());
  EXPECT_TRUE(config.positional().empty());
}

TEST(Config, FileTablesFlattenToDottedKeys) {
  ScratchDir dir;
  const fs::path file = dir.write("run.toml", R"(seed = 42
[train]
lr = 0.01
optimizer = "sgd"
[data]
path = "/scratch"
)");
  const Config config = load_file(test_schema(), file);
  EXPECT_EQ(config.get<int64_t>("seed"), 42);
  EXPECT_DOUBLE_EQ(config.get<double>("train.lr"), 0.01);
  EXPECT_EQ(config.get<std::string>("train.optimizer"), "sgd");
  EXPECT_EQ(config.get<std::string>("data.path"), "/scratch");
  EXPECT_EQ(config.get<int>("train.steps"), 100);
  EXPECT_EQ(config.source("train.lr"), ConfigSource::kFile);
  EXPECT_EQ(config.source("train.steps"), ConfigSource::kDefault);
  EXPECT_EQ(config.file(), file);
}

TEST(Config, DottedKeysAndInlineTablesInFile) {
  ScratchDir dir;
  const Config config = load_file(
      test_schema(), dir.write("run.toml", "train.steps = 5\ndata = { path = \"/x\" }\n"));
  EXPECT_EQ(config.get<int>("train.steps"), 5);
  EXPECT_EQ(config.get<std::string>("data.path"), "/x");
}

// Non-ASCII text in every kind of string and in comments reads back as written (Loom turns it
// into escapes before toml++ sees it: tests/fuzz/config.cpp found toml++ 3.3 misbehaving on it).
TEST(Config, NonAsciiStringsAndCommentsReadBackAsWritten) {
  ScratchDir dir;
  const Config config =
      load_file(test_schema(), dir.write("run.toml",
                                         "# caf\xc3\xa9 \xe2\x82\xac\n"
                                         "[train]\n"
                                         "optimizer = \"\xc3\xa9t\xc3\xa9 \\\" \xf0\x9f\x99\x82\"\n"
                                         "[data]\n"
                                         "path = 'C:\\d\xc3\xa9j\xc3\xa0 \"x\"' # \xc3\xa9\n"));
  EXPECT_EQ(config.get<std::string>("train.optimizer"), "\xc3\xa9t\xc3\xa9 \" \xf0\x9f\x99\x82");
  EXPECT_EQ(config.get<std::string>("data.path"), "C:\\d\xc3\xa9j\xc3\xa0 \"x\"");
  const Config multi =
      load_file(test_schema(), dir.write("multi.toml",
                                         "data.path = '''\nl\xc3\xa9\n\\n'''\n"
                                         "train.optimizer = \"\"\"\n\xc3\xa9\"\"\"\n"));
  EXPECT_EQ(multi.get<std::string>("data.path"), "l\xc3\xa9\n\\n");
  EXPECT_EQ(multi.get<std::string>("train.optimizer"), "\xc3\xa9");
}

// Text that TOML rules out and toml++ 3.3 would not refuse safely: ConfigError naming the file,
// line and column.
TEST(Config, MalformedTomlThatTomlPlusPlusMishandlesIsAConfigError) {
  ScratchDir dir;
  const std::pair<std::string, std::string> cases[] = {
      {"seed = 1\n[(train]\n",
       "2:2: a table header's name must start with a letter, digit, '_', '-' or a quote"},
      {"seed = 1\n[[ \t(train]]\n",
       "2:5: a table header's name must start with a letter, digit, '_', '-' or a quote"},
      {"data = [\n[ }\n]\n", "2:3: a '}' that closes no '{'"},
      {"seed = 1 ]\n", "1:10: a ']' that closes no '['"},
      {"seed\xc3\xa9 = 1\n", "1:5: a non-ASCII character outside a string or comment"},
      {"data.path = \"\xc3\x28\"\n", "1:14: invalid UTF-8"},
      {"data.path = \"\\\xc3\xa9\"\n", "1:14: an escape sequence of a non-ASCII character"},
      {"seed = 1\x01\n", "1:9: a control character (TOML allows only tab and newlines)"},
      {"data.path = 'a\nb'\n", "1:15: a string ends at the end of its line"},
      {"seed = 1\ndata.path = \'\'\'x\n\xc3\xa9\n", "2:13: a literal string that never ends"},
  };
  for (const auto& [text, where] : cases) {
    SCOPED_TRACE(text);
    const fs::path file = dir.write("bad.toml", text);
    EXPECT_EQ(error_of<ConfigError>([&] { load_file(test_schema(), file); }),
              file.string() + ":" + where);
  }
}

TEST(Config, EnvironmentVariablesAreNamedAfterKeys) {
  ScopedEnv lr("LOOM_TRAIN_LR", "0.5");
  ScopedEnv verbose("LOOM_TRAIN_VERBOSE", "yes");
  ScopedEnv unrelated("LOOM_RANK", "3");  // not a declared key: ignored, not an error
  const Config config = Config::load(test_schema(), {});
  EXPECT_DOUBLE_EQ(config.get<double>("train.lr"), 0.5);
  EXPECT_TRUE(config.get<bool>("train.verbose"));
  EXPECT_EQ(config.source("train.lr"), ConfigSource::kEnv);
}

TEST(Config, ReadEnvFalseIgnoresTheEnvironment) {
  ScopedEnv lr("LOOM_TRAIN_LR", "0.5");
  ConfigSources sources;
  sources.read_env = false;
  EXPECT_DOUBLE_EQ(Config::load(test_schema(), sources).get<double>("train.lr"), 3e-4);
}

TEST(Config, CommandLineAcceptsBothSpellings) {
  const Config config =
      parse_args(test_schema(), {"--train.steps=20", "--train.optimizer", "sgd", "--seed", "-3"});
  EXPECT_EQ(config.get<int>("train.steps"), 20);
  EXPECT_EQ(config.get<std::string>("train.optimizer"), "sgd");
  EXPECT_EQ(config.get<int64_t>("seed"), -3);
  EXPECT_EQ(config.source("train.steps"), ConfigSource::kCommandLine);
}

TEST(Config, LaterCommandLineOverrideWins) {
  const Config config = parse_args(test_schema(), {"--seed=1", "--seed=2"});
  EXPECT_EQ(config.get<int64_t>("seed"), 2);
}

TEST(Config, PrecedenceIsDefaultFileEnvCommandLine) {
  ConfigSchema schema;
  schema.add("a", 1, "").add("b", 1, "").add("c", 1, "").add("d", 1, "");
  ScratchDir dir;
  const fs::path file = dir.write("run.toml", "b = 2\nc = 2\nd = 2\n");
  ScopedEnv c("LOOM_C", "3");
  ScopedEnv d("LOOM_D", "3");
  const Config config = parse_args(schema, {"--config", file.string(), "--d=4"});
  EXPECT_EQ(config.get<int>("a"), 1);
  EXPECT_EQ(config.get<int>("b"), 2);
  EXPECT_EQ(config.get<int>("c"), 3);
  EXPECT_EQ(config.get<int>("d"), 4);
  EXPECT_EQ(config.source("a"), ConfigSource::kDefault);
  EXPECT_EQ(config.source("b"), ConfigSource::kFile);
  EXPECT_EQ(config.source("c"), ConfigSource::kEnv);
  EXPECT_EQ(config.source("d"), ConfigSource::kCommandLine);
  EXPECT_EQ(config.file(), file);
}

TEST(Config, ConfigOptionTakesEqualsForm) {
  ScratchDir dir;
  const fs::path file = dir.write("run.toml", "seed = 9\n");
  EXPECT_EQ(parse_args(test_schema(), {"--config=" + file.string()}).get<int64_t>("seed"), 9);
}

// ----- Values ----------------------------------------------------------------------------------

TEST(Config, IntegerIsAcceptedForFloatKey) {
  ScratchDir dir;
  const Config from_file = load_file(test_schema(), dir.write("run.toml", "[train]\nlr = 1\n"));
  EXPECT_DOUBLE_EQ(from_file.get<double>("train.lr"), 1.0);
  EXPECT_DOUBLE_EQ(parse_args(test_schema(), {"--train.lr=2"}).get<double>("train.lr"), 2.0);
}

TEST(Config, FloatIsRejectedForIntegerKey) {
  ScratchDir dir;
  const fs::path file = dir.write("run.toml", "[train]\nsteps = 1.5\n");
  EXPECT_EQ(
      error_of<ConfigError>([&] { load_file(test_schema(), file); }),
      "config key 'train.steps' (from " + file.string() + ":2) expects an integer, got float 1.5");
}

struct BoolCase {
  const char* text;
  bool value;
};

class ConfigBoolParsing : public ::testing::TestWithParam<BoolCase> {};

TEST_P(ConfigBoolParsing, AcceptsTheUsualWords) {
  const Config config =
      parse_args(test_schema(), {std::string("--train.verbose=") + GetParam().text});
  EXPECT_EQ(config.get<bool>("train.verbose"), GetParam().value) << GetParam().text;
}

INSTANTIATE_TEST_SUITE_P(Words, ConfigBoolParsing,
                         ::testing::Values(BoolCase{"true", true}, BoolCase{"false", false},
                                           BoolCase{"1", true}, BoolCase{"0", false},
                                           BoolCase{"yes", true}, BoolCase{"no", false},
                                           BoolCase{"on", true}, BoolCase{"off", false},
                                           BoolCase{"TRUE", true}, BoolCase{"Off", false}));

TEST(Config, BareBoolFlagMeansTrueOnlyBeforeAnOptionOrAtTheEnd) {
  const ConfigSchema schema = test_schema();
  EXPECT_TRUE(parse_args(schema, {"--train.verbose"}).get<bool>("train.verbose"));
  const Config before_option = parse_args(schema, {"--train.verbose", "--seed=1"});
  EXPECT_TRUE(before_option.get<bool>("train.verbose"));
  EXPECT_EQ(before_option.get<int64_t>("seed"), 1);
  EXPECT_FALSE(parse_args(schema, {"--train.verbose", "off"}).get<bool>("train.verbose"));
}

TEST(Config, RejectsMalformedBool) {
  EXPECT_EQ(error_of<ConfigError>([] { parse_args(test_schema(), {"--train.verbose=maybe"}); }),
            "config key 'train.verbose' (from the command line) expects a bool, got \"maybe\"");
}

TEST(Config, IntegersMustParseInFull) {
  const ConfigSchema schema = test_schema();
  EXPECT_EQ(parse_args(schema, {"--seed=+7"}).get<int64_t>("seed"), 7);
  for (const std::string bad : {"10abc", "", "1.0", " 1", "+-1", "0x10"}) {
    EXPECT_THROW(parse_args(schema, {"--seed=" + bad}), ConfigError) << '"' << bad << '"';
  }
  EXPECT_THAT(error_of<ConfigError>([&] { parse_args(schema, {"--seed=99999999999999999999"}); }),
              HasSubstr("(out of range)"));
}

TEST(Config, FloatsMustParseInFull) {
  const ConfigSchema schema = test_schema();
  EXPECT_DOUBLE_EQ(parse_args(schema, {"--train.lr=1e-3"}).get<double>("train.lr"), 1e-3);
  for (const std::string bad : {"abc", "1.5x", "", "1e999"}) {
    EXPECT_THROW(parse_args(schema, {"--train.lr=" + bad}), ConfigError) << '"' << bad << '"';
  }
}

TEST(Config, StringsAreTakenAsIs) {
  const Config config = parse_args(test_schema(), {"--data.path= /a b=c "});
  EXPECT_EQ(config.get<std::string>("data.path"), " /a b=c ");
}

// ----- Errors ----------------------------------------------------------------------------------

TEST(Config, UnknownKeyInFileSuggestsTheNearest) {
  ScratchDir dir;
  const fs::path file = dir.write("run.toml", "[train]\nlrr = 0.1\n");
  EXPECT_EQ(
      error_of<ConfigError>([&] { load_file(test_schema(), file); }),
      "unknown config key 'train.lrr' (from " + file.string() + ":2); did you mean 'train.lr'?");
}

TEST(Config, UnknownKeyOnCommandLineSuggestsTheNearest) {
  const ConfigSchema schema = test_schema();
  EXPECT_EQ(error_of<ConfigError>([&] { parse_args(schema, {"--trian.steps=1"}); }),
            "unknown config key 'trian.steps' (from the command line); did you mean "
            "'train.steps'?");
  // Without '=' the key is checked before deciding whether the next argument is its value.
  EXPECT_THAT(error_of<ConfigError>([&] {
                parse_args(schema, {"--trian.steps", "1"});
              }),
              HasSubstr("did you mean 'train.steps'?"));
  // A bare last segment suggests the full key.
  EXPECT_THAT(error_of<ConfigError>([&] { parse_args(schema, {"--optimizer=sgd"}); }),
              HasSubstr("did you mean 'train.optimizer'?"));
}

TEST(Config, UnknownKeyFarFromAllKeysSuggestsNothing) {
  EXPECT_EQ(error_of<ConfigError>([] { parse_args(test_schema(), {"--completely.different=1"}); }),
            "unknown config key 'completely.different' (from the command line); no declared key is "
            "close (--help lists them)");
}

TEST(Config, WrongTypeInFileNamesKeyTypesAndValue) {
  ScratchDir dir;
  const fs::path file = dir.write("run.toml", "[train]\nsteps = \"ten\"\n");
  EXPECT_EQ(error_of<ConfigError>([&] { load_file(test_schema(), file); }),
            "config key 'train.steps' (from " + file.string() +
                ":2) expects an integer, got string \"ten\"");
}

TEST(Config, TableOrArrayForAValueIsAWrongType) {
  ScratchDir dir;
  EXPECT_THAT(error_of<ConfigError>(
                  [&] { load_file(test_schema(), dir.write("a.toml", "seed = [1, 2]\n")); }),
              HasSubstr("'seed' (from " + (dir.path() / "a.toml").string() +
                        ":1) expects an integer, got an array"));
  EXPECT_THAT(error_of<ConfigError>(
                  [&] { load_file(test_schema(), dir.write("b.toml", "[seed]\nx = 1\n")); }),
              HasSubstr("expects an integer, got a table"));
}

TEST(Config, WrongTypeOnCommandLine) {
  EXPECT_EQ(error_of<ConfigError>([] { parse_args(test_schema(), {"--train.steps=10abc"}); }),
            "config key 'train.steps' (from the command line) expects an integer, got \"10abc\"");
}

TEST(Config, WrongTypeInEnvironmentNamesTheVariable) {
  ScopedEnv steps("LOOM_TRAIN_STEPS", "ten");
  EXPECT_EQ(error_of<ConfigError>([] { Config::load(test_schema(), {}); }),
            "config key 'train.steps' (from environment variable LOOM_TRAIN_STEPS) expects an "
            "integer, got \"ten\"");
}

TEST(Config, MissingFile) {
  ScratchDir dir;
  const fs::path file = dir.path() / "nope.toml";
  EXPECT_EQ(error_of<ConfigError>([&] {
              parse_args(test_schema(), {"--config", file.string()});
            }),
            "config file '" + file.string() + "' not found");
}

TEST(Config, MalformedTomlReportsLineAndColumn) {
  ScratchDir dir;
  const fs::path file = dir.write("bad.toml", "[train]\nlr = = 1\n");
  const std::string message = error_of<ConfigError>([&] { load_file(test_schema(), file); });
  EXPECT_THAT(message, ::testing::StartsWith(file.string() + ":2:"));
}

TEST(Config, OptionWithoutValue) {
  EXPECT_EQ(error_of<ConfigError>([] { parse_args(test_schema(), {"--train.steps"}); }),
            "command-line option --train.steps needs a value (--train.steps=VALUE)");
  EXPECT_THROW(parse_args(test_schema(), {"--train.steps", "--seed=1"}), ConfigError);
  EXPECT_THROW(parse_args(test_schema(), {"--config"}), ConfigError);
}

TEST(Config, OverrideMustBeKeyEqualsValue) {
  ConfigSources sources;
  sources.overrides = {"seed"};
  EXPECT_THAT(error_of<ConfigError>([&] { Config::load(test_schema(), sources); }),
              HasSubstr("'seed' is not of the form key=value"));
}

// ----- Schema ----------------------------------------------------------------------------------

TEST(ConfigSchema, DuplicateDeclarationIsInvalid) {
  ConfigSchema schema = test_schema();
  EXPECT_EQ(error_of<InvalidArgument>([&] { schema.add("train.lr", 0.1, ""); }),
            "config key 'train.lr' is declared twice");
  ConfigSchema other;
  other.add("seed", 1, "");
  EXPECT_THROW(schema.merge(other), InvalidArgument);
}

TEST(ConfigSchema, MergeAddsEveryKey) {
  ConfigSchema schema = test_schema();
  ConfigSchema program;
  program.add("model.layers", 12, "transformer layers");
  schema.merge(program);
  EXPECT_EQ(Config::defaults(schema).get<int>("model.layers"), 12);
}

TEST(ConfigSchema, RejectsBadNames) {
  for (const std::string bad :
       {"", "Train.lr", "train-lr", ".lr", "lr.", "train..lr", "train lr", "config", "help"}) {
    ConfigSchema schema;
    EXPECT_THROW(schema.add(bad, 1, ""), InvalidArgument) << '"' << bad << '"';
  }
  ConfigSchema schema;
  EXPECT_NO_THROW(schema.add("a_1.b2.c_", 1, ""));
}

TEST(ConfigSchema, RejectsKeysSharingAnEnvironmentVariable) {
  ConfigSchema schema;
  schema.add("train.lr", 0.1, "");
  EXPECT_EQ(error_of<InvalidArgument>([&] { schema.add("train_lr", 0.1, ""); }),
            "config keys 'train.lr' and 'train_lr' would both read environment variable "
            "LOOM_TRAIN_LR");
}

TEST(ConfigSchema, RejectsKeyThatIsAlsoATable) {
  ConfigSchema schema;
  schema.add("train.lr", 0.1, "");
  EXPECT_THROW(schema.add("train", 1, ""), InvalidArgument);
  EXPECT_NO_THROW(schema.add("trainer", 1, ""));
}

TEST(ConfigSchema, HelpAlignsOneLinePerKey) {
  ConfigSchema schema;
  schema.add("lr", 0.5, "learning rate").add("train.steps", 10, "steps").add("name", "x", "");
  EXPECT_EQ(schema.help(),
            "  --lr=<float>             learning rate (default: 0.5)\n"
            "  --train.steps=<integer>  steps (default: 10)\n"
            "  --name=<string>          (default: \"x\")\n");
}

TEST(ConfigSchema, NearestKey) {
  const ConfigSchema schema = test_schema();
  EXPECT_EQ(schema.nearest("train.step"), "train.steps");
  EXPECT_EQ(ConfigSchema().nearest("anything"), "");
  EXPECT_NE(schema.find("seed"), nullptr);
  EXPECT_EQ(schema.find("sed"), nullptr);
}

// ----- get<T> ----------------------------------------------------------------------------------

TEST(Config, GetUndeclaredKeyNamesTheNearest) {
  const Config config = Config::defaults(test_schema());
  EXPECT_EQ(error_of<InvalidArgument>([&] { config.get<int>("train.step"); }),
            "config key 'train.step' is not declared; did you mean 'train.steps'?");
  EXPECT_THROW(config.source("train.step"), InvalidArgument);
}

TEST(Config, GetWithWrongTypeIsInvalid) {
  const Config config = Config::defaults(test_schema());
  EXPECT_EQ(error_of<InvalidArgument>([&] { config.get<int>("train.lr"); }),
            "config key 'train.lr' is declared float and cannot be read as an integer");
  EXPECT_THROW(config.get<std::string>("seed"), InvalidArgument);
  EXPECT_THROW(config.get<bool>("train.optimizer"), InvalidArgument);
  EXPECT_THROW(config.get<int64_t>("train.verbose"), InvalidArgument);
  // Widening an integer to double is allowed.
  EXPECT_DOUBLE_EQ(config.get<double>("train.steps"), 100.0);
}

TEST(Config, GetIntChecksRange) {
  const Config config = parse_args(test_schema(), {"--seed=4294967296"});
  EXPECT_EQ(config.get<int64_t>("seed"), int64_t{1} << 32);
  EXPECT_THAT(error_of<InvalidArgument>([&] { config.get<int>("seed"); }),
              HasSubstr("does not fit in an int"));
}

// ----- --help and positional arguments ---------------------------------------------------------

TEST(Config, HelpThrowsHelpRequestedWithUsage) {
  for (const char* flag : {"--help", "-h"}) {
    const std::string usage = error_of<HelpRequested>([&] {
      parse_args(test_schema(), {"--seed=1", flag});
    });
    EXPECT_THAT(usage, ::testing::StartsWith("usage: train ")) << flag;
    EXPECT_THAT(usage, HasSubstr("--train.lr=<float>")) << flag;
    EXPECT_THAT(usage, HasSubstr("learning rate (default: 0.0003)")) << flag;
  }
  // --help wins even over an argument that would be an error.
  EXPECT_THROW(parse_args(test_schema(), {"--nonsense=1", "--help"}), HelpRequested);
}

TEST(Config, PositionalArgumentsAndDoubleDash) {
  const Config config =
      parse_args(test_schema(), {"input.bin", "--seed=3", "-v", "--", "--help", "--seed=4"});
  EXPECT_EQ(config.get<int64_t>("seed"), 3);
  EXPECT_EQ(config.positional(),
            (std::vector<std::string>{"input.bin", "-v", "--help", "--seed=4"}));
}

// ----- Renderings ------------------------------------------------------------------------------

TEST(Config, ToTomlRoundTrips) {
  ConfigSchema schema = test_schema();
  schema.add("a.b.c", 1.0, "").add("quote", "", "").add("small", 0.1, "").add("neg", -5, "");
  const Config original = parse_args(
      schema, {"--train.verbose", "--train.steps=-1", "--quote=say \"hi\"\\\n\ttab\x01"});
  const std::string toml = original.to_toml();
  EXPECT_THAT(toml, HasSubstr("[train]\n"));
  EXPECT_THAT(toml, HasSubstr("[a.b]\nc = 1.0\n"));
  EXPECT_THAT(toml, HasSubstr("small = 0.1\n"));

  ScratchDir dir;
  const Config reloaded = load_file(schema, dir.write("resolved.toml", toml));
  for (const ConfigKey& key : schema.keys()) {
    switch (key.type) {
      case ConfigType::kBool:
        EXPECT_EQ(reloaded.get<bool>(key.name), original.get<bool>(key.name)) << key.name;
        break;
      case ConfigType::kInt:
        EXPECT_EQ(reloaded.get<int64_t>(key.name), original.get<int64_t>(key.name)) << key.name;
        break;
      case ConfigType::kFloat:
        EXPECT_EQ(reloaded.get<double>(key.name), original.get<double>(key.name)) << key.name;
        break;
      case ConfigType::kString:
        EXPECT_EQ(reloaded.get<std::string>(key.name), original.get<std::string>(key.name))
            << key.name;
        break;
    }
  }
  EXPECT_EQ(reloaded.to_toml(), toml);
}

TEST(Config, ToJsonIsFlatWithDottedKeys) {
  const Config config = parse_args(test_schema(), {"--train.steps=5"});
  const nlohmann::json json = nlohmann::json::parse(config.to_json());
  ASSERT_TRUE(json.is_object());
  EXPECT_EQ(json.size(), test_schema().keys().size());
  EXPECT_EQ(json["train.steps"], 5);
  EXPECT_EQ(json["train.optimizer"], "adam");
  EXPECT_EQ(json["train.verbose"], false);
  EXPECT_DOUBLE_EQ(json["train.lr"].get<double>(), 3e-4);
}

TEST(Config, TypeWords) {
  EXPECT_STREQ(to_string(ConfigType::kBool), "bool");
  EXPECT_STREQ(to_string(ConfigType::kInt), "integer");
  EXPECT_STREQ(to_string(ConfigType::kFloat), "float");
  EXPECT_STREQ(to_string(ConfigType::kString), "string");
}

}  // namespace
}  // namespace loom
