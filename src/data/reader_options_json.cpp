// ReaderOptions as JSON (reader_options_json.h).
#include "data/reader_options_json.h"

namespace loom::data {

nlohmann::json reader_options_json(const ReaderOptions& o) {
  return {{"batch_size", o.batch_size},
          {"seq_len", o.seq_len},
          {"sampling", o.sampling == TokenSampling::kDocument ? "document" : "packed"},
          {"pad_id", o.pad_id},
          {"seed", o.seed},
          {"rank", o.rank},
          {"world_size", o.world_size},
          {"epoch_end", o.epoch_end == EpochEnd::kPad ? "pad" : "drop"},
          {"episode_sampling",
           o.episode_sampling == EpisodeSampling::kTransition ? "transition" : "episode"},
          {"gamma", o.gamma},
          {"gae_lambda", o.gae_lambda},
          {"image_channels", o.image_channels}};
}

ReaderOptions reader_options_from_json(const nlohmann::json& e) {
  ReaderOptions o;
  o.batch_size = e.at("batch_size").get<int64_t>();
  o.seq_len = e.at("seq_len").get<int64_t>();
  o.sampling = e.at("sampling") == "document" ? TokenSampling::kDocument : TokenSampling::kPacked;
  o.pad_id = e.at("pad_id").get<int64_t>();
  o.seed = e.at("seed").get<uint64_t>();
  o.rank = e.value("rank", 0);
  o.world_size = e.at("world_size").get<int>();
  o.epoch_end = e.at("epoch_end") == "pad" ? EpochEnd::kPad : EpochEnd::kDropLast;
  o.episode_sampling = e.at("episode_sampling") == "transition" ? EpisodeSampling::kTransition
                                                                : EpisodeSampling::kEpisode;
  o.gamma = e.at("gamma").get<double>();
  o.gae_lambda = e.at("gae_lambda").get<double>();
  o.image_channels = e.at("image_channels").get<int>();
  return o;
}

}  // namespace loom::data
