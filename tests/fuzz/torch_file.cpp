// A torch.save file (a zip holding a pickle and the tensors' storages) as `loom ckpt import`
// reads it with Loom's own unpickler.
#include <string>

#include "ckpt/torch_file.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path file = loom::fuzz::scratch_dir() / "model.pt";
  loom::fuzz::write_bytes(file, data, size);
  loom::fuzz::refuses_cleanly([&] {
    for (const auto& t : loom::ckpt::read_torch_file(file)) {
      // Every element of every tensor read is readable.
      if (t.tensor.numel() > 0) (void)t.tensor.sum().item<double>();
    }
  });
  return 0;
}
