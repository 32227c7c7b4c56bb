// loom::Config: declared keys resolved from defaults, a TOML file, LOOM_* environment variables
// and command-line overrides, in that order of precedence. See loom/config.h and docs/config.md.

#include "loom/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string_view>
#include <system_error>

#include <toml++/toml.h>

#include <nlohmann/json.hpp>
#include "config_toml.h"

namespace loom {
namespace {

using detail::concat;

// ConfigValue's alternatives are in ConfigType's order, so index() is the type.
static_assert(std::is_same_v<std::variant_alternative_t<0, ConfigValue>, bool>);
static_assert(std::is_same_v<std::variant_alternative_t<1, ConfigValue>, int64_t>);
static_assert(std::is_same_v<std::variant_alternative_t<2, ConfigValue>, double>);
static_assert(std::is_same_v<std::variant_alternative_t<3, ConfigValue>, std::string>);

ConfigType type_of(const ConfigValue& value) { return static_cast<ConfigType>(value.index()); }

const char* with_article(ConfigType type) {
  switch (type) {
    case ConfigType::kBool:
      return "a bool";
    case ConfigType::kInt:
      return "an integer";
    case ConfigType::kFloat:
      return "a float";
    case ConfigType::kString:
      return "a string";
  }
  return "a value";
}

// Where a value came from, for the resolved source and for error messages.
struct Origin {
  ConfigSource source;
  std::string where;  // "run.toml:3", "the command line", "environment variable LOOM_X"
};

// ----- Names -----------------------------------------------------------------------------------

std::string env_var_name(const std::string& key) {
  std::string name = "LOOM_";
  for (char c : key) {
    name += c == '.' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return name;
}

// Why `name` is not a valid key name, or "" when it is: lower-case [a-z0-9_] segments joined
// by single dots.
std::string name_problem(const std::string& name) {
  if (name.empty()) return "it is empty";
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.';
    if (!ok) return concat("character '", c, "' is not one of [a-z0-9_.]");
  }
  if (name.front() == '.' || name.back() == '.') return "it starts or ends with '.'";
  if (name.find("..") != std::string::npos) return "it contains '..'";
  if (name == "config" || name == "help") return "it is reserved for the command line";
  return "";
}

// True when `table` is a proper dotted prefix of `key` ("train" of "train.lr").
bool is_table_of(const std::string& table, const std::string& key) {
  return key.size() > table.size() && key.compare(0, table.size(), table) == 0 &&
         key[table.size()] == '.';
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// A declared key worth suggesting for the misspelt `name`, or "": the nearest key when it is
// close, else the only key whose last segment is `name` ("lr" -> "train.lr").
std::string suggestion(const ConfigSchema& schema, const std::string& name) {
  const std::string nearest = schema.nearest(name);
  if (!nearest.empty() && edit_distance(name, nearest) <= std::max<size_t>(2, name.size() / 3)) {
    return nearest;
  }
  const std::string suffix = "." + name;
  std::string match;
  for (const ConfigKey& key : schema.keys()) {
    const bool ends_with_suffix =
        key.name.size() > suffix.size() &&
        key.name.compare(key.name.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (!ends_with_suffix) continue;
    if (!match.empty()) return "";  // ambiguous
    match = key.name;
  }
  return match;
}

std::string did_you_mean(const ConfigSchema& schema, const std::string& name) {
  const std::string suggested = suggestion(schema, name);
  if (!suggested.empty()) return concat("; did you mean '", suggested, "'?");
  if (schema.keys().empty()) return "; no keys are declared";
  return "; no declared key is close (--help lists them)";
}

// ----- Formatting ------------------------------------------------------------------------------

// Shortest text that reads back as the same double: fixed notation unless scientific is
// clearly shorter (0.0003, 100.0, but 1e-10), and always with a '.' or an exponent so that
// TOML reads it back as a float.
std::string format_double(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value < 0 ? "-inf" : "inf";
  char fixed[400];  // the longest fixed double is about 330 characters
  char scientific[32];
  const auto fixed_end = std::to_chars(fixed, std::end(fixed), value, std::chars_format::fixed);
  const auto scientific_end =
      std::to_chars(scientific, std::end(scientific), value, std::chars_format::scientific);
  const std::string_view fixed_text(fixed, fixed_end.ptr - fixed);
  const std::string_view scientific_text(scientific, scientific_end.ptr - scientific);
  std::string text(fixed_text.size() <= scientific_text.size() + 2 ? fixed_text : scientific_text);
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

// A double-quoted string with TOML (and JSON-compatible) basic-string escapes.
std::string quote(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          char code[8];
          std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned char>(c));
          out += code;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// The value as TOML writes it: true, 42, 0.0003, "adam".
std::string format_value(const ConfigValue& value) {
  switch (type_of(value)) {
    case ConfigType::kBool:
      return std::get<bool>(value) ? "true" : "false";
    case ConfigType::kInt:
      return std::to_string(std::get<int64_t>(value));
    case ConfigType::kFloat:
      return format_double(std::get<double>(value));
    case ConfigType::kString:
      return quote(std::get<std::string>(value));
  }
  return "";
}

// ----- Errors ----------------------------------------------------------------------------------

[[noreturn]] void throw_unknown_key(const ConfigSchema& schema, const std::string& key,
                                    const Origin& origin) {
  throw ConfigError(concat("unknown config key '", key, "' (from ", origin.where, ")",
                           did_you_mean(schema, key)));
}

// `given` describes the offending value: `string "ten"`, `"10abc"`, `array`.
[[noreturn]] void throw_wrong_type(const ConfigKey& key, const Origin& origin,
                                   const std::string& given) {
  throw ConfigError(concat("config key '", key.name, "' (from ", origin.where, ") expects ",
                           with_article(key.type), ", got ", given));
}

// ----- Parsing values --------------------------------------------------------------------------

std::optional<bool> parse_bool(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (text == "true" || text == "1" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "0" || text == "no" || text == "off") return false;
  return std::nullopt;
}

// The whole of `text` as a decimal integer with an optional sign; nullopt otherwise.
// `out_of_range` is set when the digits are fine but do not fit in 64 bits.
std::optional<int64_t> parse_int(const std::string& text, bool& out_of_range) {
  std::string_view digits = text;
  if (digits.size() > 1 && digits[0] == '+' && digits[1] != '-') digits.remove_prefix(1);
  int64_t value = 0;
  const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (result.ptr != digits.data() + digits.size() || digits.empty()) return std::nullopt;
  out_of_range = result.ec == std::errc::result_out_of_range;
  if (result.ec != std::errc()) return std::nullopt;
  return value;
}

std::optional<double> parse_float(const std::string& text, bool& out_of_range) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return std::nullopt;
  out_of_range = errno == ERANGE && std::isinf(value);
  if (out_of_range) return std::nullopt;
  return value;
}

// A command-line or environment string read as the key's declared type.
ConfigValue parse_text(const ConfigKey& key, const std::string& text, const Origin& origin) {
  bool out_of_range = false;
  switch (key.type) {
    case ConfigType::kBool:
      if (auto value = parse_bool(text)) return *value;
      break;
    case ConfigType::kInt:
      if (auto value = parse_int(text, out_of_range)) return *value;
      break;
    case ConfigType::kFloat:
      if (auto value = parse_float(text, out_of_range)) return *value;
      break;
    case ConfigType::kString:
      return text;
  }
  throw_wrong_type(key, origin, quote(text) + (out_of_range ? " (out of range)" : ""));
}

std::string describe_node(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string:
      return "string " + quote(node.as_string()->get());
    case toml::node_type::integer:
      return concat("integer ", node.as_integer()->get());
    case toml::node_type::floating_point:
      return "float " + format_double(node.as_floating_point()->get());
    case toml::node_type::boolean:
      return node.as_boolean()->get() ? "bool true" : "bool false";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

// A TOML value for `key`; an integer is accepted for a float key.
ConfigValue from_toml(const ConfigKey& key, const toml::node& node, const Origin& origin) {
  switch (key.type) {
    case ConfigType::kBool:
      if (auto value = node.as_boolean()) return value->get();
      break;
    case ConfigType::kInt:
      if (auto value = node.as_integer()) return value->get();
      break;
    case ConfigType::kFloat:
      if (auto value = node.as_floating_point()) return value->get();
      if (auto value = node.as_integer()) return static_cast<double>(value->get());
      break;
    case ConfigType::kString:
      if (auto value = node.as_string()) return value->get();
      break;
  }
  throw_wrong_type(key, origin, describe_node(node));
}

// ----- Files -----------------------------------------------------------------------------------

// toml++ 3.3 (Debian 12's) misbehaves on some malformed input instead of reporting an error
// (found by tests/fuzz/config.cpp; docs/testing.md): a code point such as U+00E9 where its
// parser checks for whitespace reaches an unreachable branch (undefined behaviour), a table
// header "[(a]" or an array "[ }" breaks assumptions of its key and value parsers. So the text
// is checked and made ASCII before toml++ sees it:
//   - characters outside strings and comments must be ASCII, and no control character but tab
//     may appear outside newlines (both as TOML says);
//   - a table header's name starts with a key character or a quote, and brackets inside a
//     value close only what they opened;
//   - non-ASCII characters in strings become \uXXXX escapes (a literal string holding one
//     becomes the basic string of the same value), in comments '?'; invalid UTF-8 is an error.
// Lines stay where they were, so toml++'s line numbers stay right (its columns may shift on a
// line with such a string). Returns the ASCII text, or sets `problem` to "line:column: what".
std::string ascii_toml(const std::string& text, std::string& problem) {
  enum class In { kCode, kComment, kBasic, kLiteral, kMultiBasic, kMultiLiteral };
  In in = In::kCode;
  std::string out;
  out.reserve(text.size());
  int line = 1, column = 0;
  std::string open;          // the [ and { open inside a value, innermost last
  bool in_value = false;     // after '=' until the value's end
  bool line_start = true;    // nothing but whitespace on this line yet (outside strings)
  size_t literal_begin = 0;  // where the literal string being read starts in text
  int literal_line = 0, literal_column = 0;
  bool literal_non_ascii = false;
  auto fail = [&](const char* what) {
    problem = concat(line, ":", column, ": ", what);
    return std::string();
  };
  // Decodes the UTF-8 sequence at text[i] (advancing i to its last byte); 0 when invalid.
  auto code_point = [&](size_t& i) -> uint32_t {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    const unsigned char b = byte(i);
    const int extra = b >= 0xf0 && b <= 0xf4 ? 3 : b >= 0xe0 ? 2 : b >= 0xc2 && b < 0xe0 ? 1 : -1;
    if (extra < 0 || i + extra >= text.size()) return 0;
    uint32_t cp = b & (0x3f >> extra);
    for (int k = 1; k <= extra; ++k) {
      if ((byte(i + k) & 0xc0) != 0x80) return 0;
      cp = (cp << 6) | (byte(i + k) & 0x3f);
    }
    const uint32_t least[] = {0, 0x80, 0x800, 0x10000};
    if (cp < least[extra] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    i += static_cast<size_t>(extra);
    return cp;
  };
  auto escape = [](uint32_t cp) {
    char buffer[16];
    std::snprintf(buffer, sizeof buffer, cp <= 0xffff ? "\\u%04X" : "\\U%08X", cp);
    return std::string(buffer);
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    ++column;
    if (c == '\n') {
      if (in == In::kBasic || in == In::kLiteral)
        return fail("a string ends at the end of its line");
      if (in == In::kComment) in = In::kCode;
      if (in == In::kCode && open.empty()) in_value = false;
      if (in == In::kCode) line_start = true;
      ++line;
      column = 0;
      if (in != In::kMultiLiteral) out += '\n';
      continue;
    }
    if ((c < 0x20 && c != '\t' && !(c == '\r' && i + 1 < text.size() && text[i + 1] == '\n')) ||
        c == 0x7f) {
      return fail("a control character (TOML allows only tab and newlines)");
    }
    const bool triple = i + 2 < text.size() && text[i + 1] == text[i] && text[i + 2] == text[i];
    if (c >= 0x80 && in != In::kCode) {
      const size_t first = i;
      const uint32_t cp = code_point(i);
      if (cp == 0) return fail("invalid UTF-8");
      if (in == In::kComment) out.append(i - first + 1, '?');
      if (in == In::kBasic || in == In::kMultiBasic) out += escape(cp);
      if (in == In::kLiteral || in == In::kMultiLiteral) literal_non_ascii = true;
      continue;
    }
    switch (in) {
      case In::kComment:
        out += static_cast<char>(c);
        break;
      case In::kBasic:
      case In::kMultiBasic:
        out += static_cast<char>(c);
        if (c == '\\') {
          // The escaped character cannot end the string (a newline after it is a line break).
          if (i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80)
            return fail("an escape sequence of a non-ASCII character");
          if (i + 1 < text.size() && text[i + 1] != '\n' && text[i + 1] != '\r') {
            out += text[++i];
            ++column;
          }
        } else if (c == '"' && in == In::kBasic) {
          in = In::kCode;
        } else if (c == '"' && triple) {
          // Up to two more quotes belong to the string: """a"""""
          out += "\"\"";
          i += 2, column += 2;
          while (i + 1 < text.size() && text[i + 1] == '"') out += text[++i], ++column;
          in = In::kCode;
        }
        break;
      case In::kLiteral:
      case In::kMultiLiteral: {
        const bool ends = c == '\'' && (in == In::kLiteral || triple);
        if (!ends) break;
        size_t end = i + (in == In::kLiteral ? 1 : 3);  // one past the closing quotes
        if (in == In::kMultiLiteral) {
          while (end < text.size() && text[end] == '\'') ++end;
        }
        column += static_cast<int>(end - 1 - i);
        i = end - 1;
        const std::string literal = text.substr(literal_begin, end - literal_begin);
        if (!literal_non_ascii) {
          out += literal;
        } else {
          // The basic string of the same value: quotes and backslashes escaped, non-ASCII as
          // \u escapes, newlines kept.
          const size_t quotes = in == In::kLiteral ? 1 : 3;
          const std::string delimiter(quotes, '"');
          out += delimiter;
          for (size_t k = literal_begin + quotes; k < end - quotes; ++k) {
            const unsigned char b = static_cast<unsigned char>(text[k]);
            if (b == '"' || b == '\\') {
              out += '\\';
              out += static_cast<char>(b);
            } else if (b >= 0x80) {
              out += escape(code_point(k));  // checked valid when it was read
            } else {
              out += static_cast<char>(b);
            }
          }
          out += delimiter;
        }
        in = In::kCode;
        break;
      }
      case In::kCode:
        if (c >= 0x80) return fail("a non-ASCII character outside a string or comment");
        if (c == '"' || c == '\'') {
          in = triple ? (c == '"' ? In::kMultiBasic : In::kMultiLiteral)
                      : (c == '"' ? In::kBasic : In::kLiteral);
          if (c == '\'') {
            literal_begin = i;
            literal_line = line;
            literal_column = column;
            literal_non_ascii = false;
          } else {
            out += triple ? "\"\"\"" : "\"";
          }
          if (triple) i += 2, column += 2;
          line_start = false;
          break;
        }
        out += static_cast<char>(c);
        if (c == ' ' || c == '\t' || c == '\r') break;
        if (c == '#') {
          in = In::kComment;
        } else if (c == '=') {
          in_value = true;
        } else if (c == '[' && line_start && !in_value) {
          // A table header: [name] or [[name]]; the name starts with a key character or a quote.
          size_t j = i + 1;
          if (j < text.size() && text[j] == '[') ++j;
          while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) ++j;
          const char k = j < text.size() ? text[j] : '\0';
          if (!(std::isalnum(static_cast<unsigned char>(k)) || k == '_' || k == '-' || k == '"' ||
                k == '\'')) {
            column += static_cast<int>(j - i);
            return fail(
                "a table header's name must start with a letter, digit, '_', '-' or a quote");
          }
        } else if (in_value && (c == '[' || c == '{')) {
          open.push_back(static_cast<char>(c));
        } else if (in_value && (c == ']' || c == '}')) {
          if (open.empty() || open.back() != (c == ']' ? '[' : '{'))
            return fail(c == ']' ? "a ']' that closes no '['" : "a '}' that closes no '{'");
          open.pop_back();
        }
        line_start = false;
        break;
    }
  }
  // An unterminated literal string is an error here: handed over, its bytes would reach toml++
  // unescaped.
  if (in == In::kLiteral || in == In::kMultiLiteral) {
    line = literal_line;
    column = literal_column;
    return fail("a literal string that never ends");
  }
  return out;
}

toml::table parse_toml_file(const std::filesystem::path& path, const char* what) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    throw ConfigError(concat(what, " '", path.string(), "' not found"));
  }
  if (std::filesystem::is_directory(path, error)) {
    throw ConfigError(concat(what, " '", path.string(), "' is a directory"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(
        concat(what, " '", path.string(), "' cannot be read: ", std::strerror(errno)));
  }
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::string problem;
  const std::string ascii = ascii_toml(text, problem);
  if (!problem.empty()) throw ConfigError(concat(path.string(), ":", problem));
  try {
    return toml::parse(ascii, path.string());
  } catch (const toml::parse_error& e) {
    const toml::source_position where = e.source().begin;
    throw ConfigError(
        concat(path.string(), ":", where.line, ":", where.column, ": ", e.description()));
  }
}

// Calls visit(dotted_key, node) for every non-table node under `table`, and for a table at the
// path of a declared key, so that it is reported as a wrong type.
template <typename Visit>
void flatten(const ConfigSchema& schema, const toml::table& table, const std::string& prefix,
             const Visit& visit) {
  for (const auto& [name, node] : table) {
    const std::string leaf(name.str());
    const std::string key = prefix.empty() ? leaf : prefix + "." + leaf;
    if (node.is_table() && schema.find(key) == nullptr) {
      flatten(schema, *node.as_table(), key, visit);
    } else {
      visit(key, node);
    }
  }
}

std::string file_location(const std::filesystem::path& path, const toml::node& node) {
  const auto line = node.source().begin.line;
  return line > 0 ? concat(path.string(), ":", line) : path.string();
}

}  // namespace

toml::table internal::read_toml_file(const std::filesystem::path& path, const char* what) {
  return parse_toml_file(path, what);
}

const char* to_string(ConfigType type) {
  switch (type) {
    case ConfigType::kBool:
      return "bool";
    case ConfigType::kInt:
      return "integer";
    case ConfigType::kFloat:
      return "float";
    case ConfigType::kString:
      return "string";
  }
  return "unknown";
}

// ----- ConfigSchema ----------------------------------------------------------------------------

ConfigSchema& ConfigSchema::add(const std::string& name, bool default_value,
                                const std::string& help) {
  return add_key({name, ConfigType::kBool, default_value, help});
}

ConfigSchema& ConfigSchema::add(const std::string& name, int64_t default_value,
                                const std::string& help) {
  return add_key({name, ConfigType::kInt, default_value, help});
}

ConfigSchema& ConfigSchema::add(const std::string& name, int default_value,
                                const std::string& help) {
  return add_key({name, ConfigType::kInt, static_cast<int64_t>(default_value), help});
}

ConfigSchema& ConfigSchema::add(const std::string& name, double default_value,
                                const std::string& help) {
  return add_key({name, ConfigType::kFloat, default_value, help});
}

ConfigSchema& ConfigSchema::add(const std::string& name, const std::string& default_value,
                                const std::string& help) {
  return add_key({name, ConfigType::kString, default_value, help});
}

ConfigSchema& ConfigSchema::add(const std::string& name, const char* default_value,
                                const std::string& help) {
  LOOM_CHECK(default_value != nullptr, InvalidArgument, "config key '", name,
             "': the default string is null");
  return add(name, std::string(default_value), help);
}

ConfigSchema& ConfigSchema::merge(const ConfigSchema& other) {
  for (const ConfigKey& key : other.keys_) add_key(key);
  return *this;
}

ConfigSchema& ConfigSchema::add_key(ConfigKey key) {
  const std::string problem = name_problem(key.name);
  LOOM_CHECK(problem.empty(), InvalidArgument, "invalid config key name '", key.name,
             "': ", problem);
  LOOM_CHECK(type_of(key.default_value) == key.type, InvalidArgument, "config key '", key.name,
             "' is declared ", to_string(key.type), " but its default is ",
             to_string(type_of(key.default_value)));
  const std::string env = env_var_name(key.name);
  for (const ConfigKey& other : keys_) {
    LOOM_CHECK(other.name != key.name, InvalidArgument, "config key '", key.name,
               "' is declared twice");
    LOOM_CHECK(env_var_name(other.name) != env, InvalidArgument, "config keys '", other.name,
               "' and '", key.name, "' would both read environment variable ", env);
    LOOM_CHECK(!is_table_of(other.name, key.name) && !is_table_of(key.name, other.name),
               InvalidArgument, "config keys '", other.name, "' and '", key.name,
               "' clash: a key cannot also be a table of keys");
  }
  keys_.push_back(std::move(key));
  return *this;
}

const ConfigKey* ConfigSchema::find(const std::string& name) const {
  for (const ConfigKey& key : keys_) {
    if (key.name == name) return &key;
  }
  return nullptr;
}

std::string ConfigSchema::nearest(const std::string& name) const {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const ConfigKey& key : keys_) {
    const size_t distance = edit_distance(name, key.name);
    if (distance < best_distance) {
      best = key.name;
      best_distance = distance;
    }
  }
  return best;
}

std::string ConfigSchema::help() const {
  std::vector<std::string> options;
  size_t width = 0;
  for (const ConfigKey& key : keys_) {
    options.push_back(concat("--", key.name, "=<", to_string(key.type), ">"));
    width = std::max(width, options.back().size());
  }
  std::string text;
  for (size_t i = 0; i < keys_.size(); ++i) {
    const ConfigKey& key = keys_[i];
    text += "  " + options[i] + std::string(width - options[i].size() + 2, ' ');
    if (!key.help.empty()) text += key.help + " ";
    text += "(default: " + format_value(key.default_value) + ")\n";
  }
  return text;
}

// ----- Config ----------------------------------------------------------------------------------

Config Config::defaults(const ConfigSchema& schema) {
  Config config;
  config.schema_ = schema;
  for (const ConfigKey& key : schema.keys()) {
    config.values_[key.name] = Entry{key.default_value, ConfigSource::kDefault};
  }
  return config;
}

Config Config::load(const ConfigSchema& schema, const ConfigSources& sources) {
  Config config = defaults(schema);
  if (sources.file) {
    const toml::table table = parse_toml_file(*sources.file, "config file");
    flatten(schema, table, "", [&](const std::string& name, const toml::node& node) {
      const Origin origin{ConfigSource::kFile, file_location(*sources.file, node)};
      const ConfigKey* key = schema.find(name);
      if (key == nullptr) throw_unknown_key(schema, name, origin);
      config.values_[name] = Entry{from_toml(*key, node, origin), origin.source};
    });
    config.file_ = sources.file;
  }
  if (sources.read_env) {
    for (const ConfigKey& key : schema.keys()) {
      const std::string env = env_var_name(key.name);
      const char* text = std::getenv(env.c_str());
      if (text == nullptr) continue;
      const Origin origin{ConfigSource::kEnv, "environment variable " + env};
      config.values_[key.name] = Entry{parse_text(key, text, origin), origin.source};
    }
  }
  const Origin command_line{ConfigSource::kCommandLine, "the command line"};
  for (const std::string& override_text : sources.overrides) {
    const size_t equals = override_text.find('=');
    if (equals == std::string::npos) {
      throw ConfigError(
          concat("command-line override '", override_text, "' is not of the form key=value"));
    }
    const std::string name = override_text.substr(0, equals);
    const ConfigKey* key = schema.find(name);
    if (key == nullptr) throw_unknown_key(schema, name, command_line);
    config.values_[name] = Entry{parse_text(*key, override_text.substr(equals + 1), command_line),
                                 command_line.source};
  }
  return config;
}

namespace {

std::string usage(const ConfigSchema& schema, const char* program) {
  const std::string name =
      program != nullptr ? std::filesystem::path(program).filename().string() : "program";
  return concat("usage: ", name, " [--config=FILE] [--key=value ...] [--] [args ...]\n\n",
                "  --config=FILE  a TOML file of config keys\n",
                "  --help, -h     print this text\n\n",
                "Config keys (default < --config file < LOOM_<KEY> variable < command line):\n",
                schema.help());
}

bool is_option(const char* arg) { return std::strncmp(arg, "--", 2) == 0; }

}  // namespace

Config Config::from_args(const ConfigSchema& schema, int argc, const char* const* argv) {
  for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      throw HelpRequested(usage(schema, argc > 0 ? argv[0] : nullptr));
    }
  }
  ConfigSources sources;
  std::vector<std::string> positional;
  bool options_done = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (options_done || !is_option(argv[i])) {
      positional.push_back(arg);
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    const size_t equals = arg.find('=');
    const std::string name = arg.substr(2, equals == std::string::npos ? equals : equals - 2);
    const bool has_next_value = i + 1 < argc && !is_option(argv[i + 1]);
    std::string value;
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (name != "config" && schema.find(name) == nullptr) {
      throw_unknown_key(schema, name, {ConfigSource::kCommandLine, "the command line"});
    } else if (name != "config" && schema.find(name)->type == ConfigType::kBool &&
               !has_next_value) {
      value = "true";
    } else if (has_next_value) {
      value = argv[++i];
    } else {
      throw ConfigError(concat("command-line option ", arg, " needs a value (", arg, "=VALUE)"));
    }
    if (name == "config") {
      sources.file = value;
    } else {
      sources.overrides.push_back(name + "=" + value);
    }
  }
  Config config = load(schema, sources);
  config.positional_ = std::move(positional);
  return config;
}

const Config::Entry& Config::entry(const std::string& key, ConfigType want) const {
  const ConfigKey* declared = schema_.find(key);
  if (declared == nullptr) {
    throw InvalidArgument(
        concat("config key '", key, "' is not declared", did_you_mean(schema_, key)));
  }
  const bool widening = want == ConfigType::kFloat && declared->type == ConfigType::kInt;
  LOOM_CHECK(declared->type == want || widening, InvalidArgument, "config key '", key,
             "' is declared ", to_string(declared->type), " and cannot be read as ",
             with_article(want));
  return values_.at(key);
}

template <>
bool Config::get<bool>(const std::string& key) const {
  return std::get<bool>(entry(key, ConfigType::kBool).value);
}

template <>
int64_t Config::get<int64_t>(const std::string& key) const {
  return std::get<int64_t>(entry(key, ConfigType::kInt).value);
}

template <>
int Config::get<int>(const std::string& key) const {
  const int64_t value = get<int64_t>(key);
  LOOM_CHECK(value >= std::numeric_limits<int>::min() && value <= std::numeric_limits<int>::max(),
             InvalidArgument, "config key '", key, "' is ", value,
             ", which does not fit in an int; read it as int64_t");
  return static_cast<int>(value);
}

template <>
double Config::get<double>(const std::string& key) const {
  const ConfigValue& value = entry(key, ConfigType::kFloat).value;
  if (const auto* integer = std::get_if<int64_t>(&value)) return static_cast<double>(*integer);
  return std::get<double>(value);
}

template <>
std::string Config::get<std::string>(const std::string& key) const {
  return std::get<std::string>(entry(key, ConfigType::kString).value);
}

ConfigSource Config::source(const std::string& key) const {
  const auto it = values_.find(key);
  if (it == values_.end()) {
    throw InvalidArgument(
        concat("config key '", key, "' is not declared", did_you_mean(schema_, key)));
  }
  return it->second.source;
}

std::string Config::to_toml() const {
  // Keys grouped by table ("" for top-level keys, which must come before any [table]).
  std::map<std::string, std::vector<std::pair<std::string, const ConfigValue*>>> tables;
  for (const auto& [key, entry] : values_) {
    const size_t dot = key.rfind('.');
    const std::string table = dot == std::string::npos ? "" : key.substr(0, dot);
    tables[table].emplace_back(key.substr(dot + 1), &entry.value);
  }
  std::string text;
  for (const auto& [table, values] : tables) {
    if (!table.empty()) text += (text.empty() ? "[" : "\n[") + table + "]\n";
    for (const auto& [name, value] : values) text += name + " = " + format_value(*value) + "\n";
  }
  return text;
}

std::string Config::to_json() const {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& [key, entry] : values_) {
    std::visit([&json, &key = key](const auto& value) { json[key] = value; }, entry.value);
  }
  return json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace loom
