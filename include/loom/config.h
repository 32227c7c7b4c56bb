// Typed configuration: declared keys with defaults, layered from a TOML file, the
// environment and --key=value command-line overrides.
//
// Precedence, lowest to highest: the declared default, the TOML file (--config=FILE),
// environment variables (LOOM_ + the key upper-cased with '.' -> '_', e.g. train.lr ->
// LOOM_TRAIN_LR), then --key=value on the command line. Keys are dotted paths; a TOML table
// [train] with lr = 3e-4 sets "train.lr".
//
// Every key must be declared in a ConfigSchema. An unknown key in the file or on the command
// line is a ConfigError naming it and the nearest declared key; a value of the wrong type is a
// ConfigError naming the key, the expected and the given type. A Config is immutable after
// load and safe to read from many threads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "loom/error.h"
#include "loom/visibility.h"

namespace loom {

enum class ConfigType { kBool, kInt, kFloat, kString };

// "bool", "integer", "float", "string": the words error messages use.
LOOM_API const char* to_string(ConfigType type);

using ConfigValue = std::variant<bool, int64_t, double, std::string>;

// Where a resolved value came from; reported by Config::source().
enum class ConfigSource { kDefault, kFile, kEnv, kCommandLine };

struct ConfigKey {
  std::string name;           // dotted path, e.g. "train.lr"
  ConfigType type;            // the only type the key accepts (an integer is accepted for float)
  ConfigValue default_value;  // of `type`
  std::string help;           // one line for --help
};

// The declared keys. Programs add their own keys to the schema Runtime declares
// (Runtime::schema()). A name is lower-case [a-z0-9_] segments joined by '.'. Adding a key twice,
// a malformed name, "config" or "help" (reserved for the command line), two keys that read the
// same environment variable (a.b and a_b), or a key that is also a table of other keys (train
// beside train.lr) is InvalidArgument.
class LOOM_API ConfigSchema {
 public:
  ConfigSchema& add(const std::string& name, bool default_value, const std::string& help);
  ConfigSchema& add(const std::string& name, int64_t default_value, const std::string& help);
  ConfigSchema& add(const std::string& name, int default_value, const std::string& help);
  ConfigSchema& add(const std::string& name, double default_value, const std::string& help);
  ConfigSchema& add(const std::string& name, const std::string& default_value,
                    const std::string& help);
  ConfigSchema& add(const std::string& name, const char* default_value, const std::string& help);
  // Adds every key of `other`; a key declared in both is InvalidArgument.
  ConfigSchema& merge(const ConfigSchema& other);

  const ConfigKey* find(const std::string& name) const;  // nullptr when undeclared
  const std::vector<ConfigKey>& keys() const { return keys_; }
  // The declared key closest to `name` by edit distance ("" when the schema is empty).
  std::string nearest(const std::string& name) const;
  // The usage text: one line per key with type, default and help.
  std::string help() const;

 private:
  ConfigSchema& add_key(ConfigKey key);
  std::vector<ConfigKey> keys_;
};

// What to layer over the schema's defaults.
struct ConfigSources {
  std::optional<std::filesystem::path> file;  // a TOML file; missing or malformed: ConfigError
  bool read_env = true;                       // LOOM_<KEY> variables
  std::vector<std::string> overrides;         // "key=value" (--key=value without the --), in order
};

// Thrown by Config::from_args when --help or -h is given; what() is the usage text.
// Not an error: programs print it and exit 0 (loom::run_main does this).
class LOOM_API HelpRequested : public Error {
 public:
  using Error::Error;
};

class LOOM_API Config {
 public:
  // Parses argv: --config=FILE (or --config FILE), --key=value (or --key value), --help.
  // Arguments that do not start with "--" are kept in positional(). The environment is read.
  static Config from_args(const ConfigSchema& schema, int argc, const char* const* argv);
  static Config load(const ConfigSchema& schema, const ConfigSources& sources);
  // Defaults only: no file, no environment, no overrides.
  static Config defaults(const ConfigSchema& schema);

  // The value of a declared key as T (bool, int, int64_t, double, std::string). An undeclared
  // key or a T that does not match the declared type is InvalidArgument.
  template <typename T>
  T get(const std::string& key) const;

  ConfigSource source(const std::string& key) const;
  const ConfigSchema& schema() const { return schema_; }
  const std::vector<std::string>& positional() const { return positional_; }
  const std::optional<std::filesystem::path>& file() const { return file_; }

  // The resolved configuration as a TOML document (what the run actually used).
  std::string to_toml() const;
  // The resolved configuration as a JSON object string, keys dotted.
  std::string to_json() const;

 private:
  struct Entry {
    ConfigValue value;
    ConfigSource source = ConfigSource::kDefault;
  };
  const Entry& entry(const std::string& key, ConfigType want) const;

  ConfigSchema schema_;
  std::map<std::string, Entry> values_;
  std::vector<std::string> positional_;
  std::optional<std::filesystem::path> file_;
};

template <>
bool Config::get<bool>(const std::string& key) const;
template <>
int64_t Config::get<int64_t>(const std::string& key) const;
template <>
int Config::get<int>(const std::string& key) const;
template <>
double Config::get<double>(const std::string& key) const;
template <>
std::string Config::get<std::string>(const std::string& key) const;

}  // namespace loom
