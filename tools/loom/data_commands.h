// The parts of `loom data` that live in their own files.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/data/reader.h"

namespace loom::cli {

// What `loom data show` and `loom data serve` read: a dataset and the reader options of the
// run whose samples they show.
struct DataPosition {
  std::string dir;
  int world = 1;
  int64_t batch = 4;
  int64_t seq_len = 64;
  uint64_t seed = 0;
  std::string sampling;  // "": packed (tokens) or episode (episodes)
  std::string epoch_end = "drop";
  int image_channels = 0;
};

// Adds DataPosition's options (--world, --batch, --seq-len, --seed, --sampling, --epoch-end,
// --image-channels).
void add_position_options(CLI::App& command, DataPosition& position);

// Row r of a batch's field `name` as the record held it: a ragged tensor without its padding
// (by "<name>_mask"), or image `k` of an image field (k = -1) or images field without its
// padding, [H, W, C] (by "<name>_size"). Undefined for an empty slot of an images field.
at::Tensor unpadded(const data::Batch& batch, const std::string& name, int64_t r);
at::Tensor image_of(const data::Batch& batch, const std::string& name, int64_t r, int64_t k = -1);

// Rank `rank`'s reader of the run, positioned so that its next() is the batch the rank reads
// at training step `step` (counting from 0 over all epochs), as the Trainer's reader does.
std::unique_ptr<data::Reader> reader_at(const DataPosition& position, int rank, uint64_t step);

// `loom data serve DATASET` (data_serve.cpp), added under `data`.
void register_data_serve(CLI::App& data, Action& action);

// `loom data build text|fashion-mnist|jsonl|images|webdataset` (data_build.cpp), added under
// `data`.
void register_data_build(CLI::App& data, Action& action);

// `loom data register|ls|info|tag|diff|migrate` (data_registry.cpp), added under `data`.
void register_data_registry(CLI::App& data, Action& action);

}  // namespace loom::cli
