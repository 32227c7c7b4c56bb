// data::Batch, one rank's samples for one step, and data::BatchSource, what yields them step
// after step with a resumable position: data::Reader (one dataset) and data::Mixture (several,
// weighted). The Trainer reads from a BatchSource and checkpoints its state.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::data {

// One rank's samples for one step (data/reader.h describes the tensors of each dataset kind).
struct LOOM_API Batch {
  std::map<std::string, at::Tensor> tensors;                // see data/reader.h
  std::map<std::string, std::vector<std::string>> strings;  // text and bytes fields
  std::vector<uint64_t> indices;  // the sample index of each row in its dataset
  std::vector<uint32_t> sources;  // Mixture: each row's source; empty from a Reader
  int64_t num_real = 0;           // rows [0, num_real) are real; the rest are padding
  uint64_t epoch = 0;             // the epoch these samples belong to (Reader)
  // The tensor named `name`; InvalidArgument naming the batch's tensors when absent.
  const at::Tensor& operator[](const std::string& name) const;
};

// Step-by-step batches with a position that can be saved and restored. Every rank calls
// next() once per step; state_json() is the same on every rank after every step.
class LOOM_API BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch next() = 0;
  virtual int64_t batch_size() const = 0;  // rows per rank per step
  // The position after the last next(), as JSON, and its inverse: restore_json continues
  // exactly after it (at this source's world size and batch size). A state of another source
  // is InvalidArgument; malformed JSON is CorruptData.
  virtual std::string state_json() const = 0;
  virtual void restore_json(const std::string& json) = 0;
};

}  // namespace loom::data
