// A checkpoint step's manifest.json, as load and `loom ckpt` parse and check it, and the step
// directory names that listing parses.
#include <string>

#include "ckpt/manifest.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  (void)loom::ckpt::parse_step_dir_name(text);
  loom::fuzz::refuses_cleanly([&] {
    const loom::ckpt::Manifest m = loom::ckpt::parse_manifest(text, "fuzz/manifest.json");
    for (const auto& t : m.tensors) (void)loom::ckpt::parse_dtype(t.dtype);
  });
  return 0;
}
