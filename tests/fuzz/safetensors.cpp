// A .safetensors file as `loom ckpt import` reads it: the header's JSON, every claim it makes
// about dtypes, shapes and offsets, and the tensors built from it.
#include <map>
#include <string>

#include "ckpt/safetensors.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path file = loom::fuzz::scratch_dir() / "model.safetensors";
  loom::fuzz::write_bytes(file, data, size);
  loom::fuzz::refuses_cleanly([&] {
    std::map<std::string, std::string> metadata;
    for (const auto& t : loom::ckpt::read_safetensors(file, &metadata)) {
      // Every element of every tensor read is readable.
      if (t.tensor.numel() > 0) (void)t.tensor.sum().item<double>();
    }
  });
  return 0;
}
