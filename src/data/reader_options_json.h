// ReaderOptions as JSON: the fields a reader's position depends on (and rank), as readers.json
// records them and the data service's requests carry them. Private to Loom.
#pragma once

#include <nlohmann/json.hpp>

#include "loom/data/reader.h"

namespace loom::data {

// batch_size, seq_len, sampling, pad_id, seed, rank, world_size, epoch_end, episode_sampling,
// gamma, gae_lambda and image_channels; the rest are left out.
nlohmann::json reader_options_json(const ReaderOptions& options);
// The inverse; fields absent from `j` keep their defaults except those readers.json has always
// held, whose absence is nlohmann::json's out_of_range (callers name the file or request).
ReaderOptions reader_options_from_json(const nlohmann::json& j);

}  // namespace loom::data
