// Reading a checkpoint directory without a Checkpointer (loom/ckpt/inspect.h).
#include "loom/ckpt/inspect.h"

#include "ckpt/manifest.h"
#include "ckpt/reader.h"
#include "ckpt/storage.h"
#include "loom/error.h"

namespace loom::ckpt {

namespace fs = std::filesystem;

fs::path step_path(const fs::path& dir, int64_t step) { return dir / step_dir_name(step); }

StepSummary describe_step(const fs::path& dir, int64_t step) {
  const fs::path path = step_path(dir, step);
  const Manifest m = read_manifest(path);
  StepSummary summary{.step = step,
                      .path = path,
                      .world_size = m.world_size,
                      .bytes = m.data_bytes(),
                      .files = m.files.size(),
                      .blobs = m.blobs};
  for (const TensorRecord& t : m.tensors) {
    uint64_t bytes = 0;
    for (const Piece& p : t.pieces) bytes += p.bytes;
    summary.tensors.push_back({t.name, t.dtype, t.shape, t.kind, t.pieces.size(), bytes});
  }
  return summary;
}

uint64_t verify_step(const fs::path& dir, int64_t step) {
  const fs::path path = step_path(dir, step);
  StepReader reader(posix_storage(), path, read_manifest(path));
  return reader.verify_all();
}

}  // namespace loom::ckpt
