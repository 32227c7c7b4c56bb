// The parts of `loom data` that live in their own files.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "data/run_readers.h"
#include "loom/data/mixture.h"
#include "loom/data/reader.h"

namespace loom::cli {

// What `loom data show` and `loom data serve` read: a dataset and the reader options of the
// run whose samples they show.
struct DataPosition {
  std::string dir;  // the dataset; or a run directory, until from_run() replaces it
  int world = 1;
  int64_t batch = 4;
  int64_t seq_len = 64;
  uint64_t seed = 0;
  std::string sampling;  // "": packed (tokens) or episode (episodes)
  std::string epoch_end = "drop";
  int image_channels = 0;
  int64_t pad_id = 0;                      // from a run only
  double gamma = 0.99, gae_lambda = 0.95;  // from a run only
  std::string run;                         // the run directory `dir` named, once from_run() read it
  int reader = 0;                          // --reader: which of the run's readers
  bool checkpointed = false;               // the run has a checkpoint (from_run)
  // A run's mixture (Runtime::open_mixture): its sources; `dir` is then the first one's.
  std::vector<data::RunReader::Source> mix;
  std::vector<const CLI::Option*> options;  // the position options, refused with a run
};

// Adds DataPosition's options (--world, --batch, --seq-len, --seed, --sampling, --epoch-end,
// --image-channels, --reader).
void add_position_options(CLI::App& command, DataPosition& position);

// When position.dir is a run directory (it holds readers.json): replaces the dataset and the
// options by those of the run's reader number position.reader (data/run_readers.h), and
// returns the step its newest checkpoint in <run>/ckpt resumes at (the step whose batch the run
// reads next; 0 without a checkpoint). nullopt, changing nothing, when dir is a dataset. A
// position option given on the command line with a run directory is InvalidArgument, as is a
// --reader the run does not have.
std::optional<uint64_t> from_run(DataPosition& position);

// Row r of a batch's field `name` as the record held it: a ragged tensor without its padding
// (by "<name>_mask"), or image `k` of an image field (k = -1) or images field without its
// padding, [H, W, C] (by "<name>_size"). Undefined for an empty slot of an images field.
at::Tensor unpadded(const data::Batch& batch, const std::string& name, int64_t r);
at::Tensor image_of(const data::Batch& batch, const std::string& name, int64_t r, int64_t k = -1);

// Rank `rank`'s reader of the run, positioned so that its next() is the batch the rank reads
// at training step `step` (counting from 0 over all epochs), as the Trainer's reader does.
std::unique_ptr<data::Reader> reader_at(const DataPosition& position, int rank, uint64_t step);

// The same for a run's mixture (position.mix): skipped to `step` (Mixture::skip).
std::unique_ptr<data::Mixture> mixture_at(const DataPosition& position, int rank, uint64_t step);

// `loom data serve DATASET` (data_serve.cpp), added under `data`.
void register_data_serve(CLI::App& data, Action& action);

// `loom data service` (data_service.cpp), added under `data`.
void register_data_service(CLI::App& data, Action& action);

// `loom data build text|fashion-mnist|jsonl|images|webdataset` (data_build.cpp), added under
// `data`.
void register_data_build(CLI::App& data, Action& action);

// `loom data register|ls|info|tag|diff|migrate` (data_registry.cpp), added under `data`.
void register_data_registry(CLI::App& data, Action& action);

}  // namespace loom::cli
