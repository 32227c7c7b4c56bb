// Config: a TOML file and --key=value overrides, from the fuzzer's bytes. The input is the TOML
// text, then optionally a line "--" followed by one override per line.
#include <string>
#include <vector>

#include "fuzz.h"
#include "loom/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom::ConfigSchema schema = [] {
    loom::ConfigSchema s;
    s.add("train.steps", int64_t{10}, "an integer");
    s.add("train.lr", 0.1, "a real");
    s.add("train.resume", true, "a flag");
    s.add("run.name", std::string("x"), "a string");
    s.add("data.weights", std::string(""), "a list as text");
    return s;
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto split = text.find("\n--\n");
  const std::string toml = text.substr(0, split);
  loom::ConfigSources sources{.file = loom::fuzz::scratch_dir() / "config.toml", .read_env = false};
  if (split != std::string::npos) {
    std::string rest = text.substr(split + 4);
    for (size_t at = 0; at <= rest.size();) {
      const size_t end = std::min(rest.find('\n', at), rest.size());
      sources.overrides.push_back(rest.substr(at, end - at));
      at = end + 1;
    }
  }
  loom::fuzz::write_bytes(*sources.file, reinterpret_cast<const uint8_t*>(toml.data()),
                          toml.size());
  loom::fuzz::refuses_cleanly([&] {
    const loom::Config config = loom::Config::load(schema, sources);
    (void)config.get<int64_t>("train.steps");
    (void)config.get<double>("train.lr");
    (void)config.get<bool>("train.resume");
    (void)config.get<std::string>("run.name");
  });
  return 0;
}
