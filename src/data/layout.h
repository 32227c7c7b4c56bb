// The rules of the record layouts (data::RecordLayout: multimodal sequences, RL episodes) and
// the values the Reader derives from episodes (returns, GAE advantages). Private to Loom: the
// writer checks every record with them, the Reader every record it reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/shard_format.h"
#include "loom/data/dataset.h"

namespace loom::data::layout {

// Where each role's field is in the schema (-1: absent, for the optional ones).
struct EpisodeFields {
  int observation = -1, action = -1, reward = -1, done = -1, log_prob = -1, value = -1;
};
struct MultimodalFields {
  int tokens = -1, images = -1, positions = -1;
};

// "" or what `schema` lacks for `layout`, naming the field and the rule. Also checks, for any
// layout, that only per-record-shape tensor fields are ragged.
std::string check_schema(RecordLayout layout, const std::vector<Field>& schema);
// The role fields of a schema check_schema accepted.
EpisodeFields episode_fields(const std::vector<Field>& schema);
MultimodalFields multimodal_fields(const std::vector<Field>& schema);

// "" or what is wrong with one decoded record (views[i] is schema field i) under `layout`:
// episode fields of different lengths (naming both fields and lengths), image positions that
// do not match the images or the tokens.
std::string check_record(RecordLayout layout, const std::vector<Field>& schema,
                         const format::FieldView* views);

// An episode's length: its reward field's first dimension.
inline int64_t episode_length(const EpisodeFields& f, const format::FieldView* views) {
  return views[f.reward].dims[0];
}

// The discounted reward to go of each step of one episode of `length` steps, in float64:
// G[t] = r[t] + gamma * (1 - done[t]) * G[t + 1], G[length] = 0. `done` holds one byte per step
// (uint8 or bool). Writes `length` values to `out`.
void discounted_returns(const float* reward, const uint8_t* done, int64_t length, double gamma,
                        float* out);
// Generalised advantage estimation (Schulman et al. 2016) over one episode: delta[t] = r[t] +
// gamma * (1 - done[t]) * V[t + 1] - V[t] with V[length] = 0, A[t] = delta[t] + gamma * lambda *
// (1 - done[t]) * A[t + 1]; accumulated in float64.
void gae_advantages(const float* reward, const uint8_t* done, const float* value, int64_t length,
                    double gamma, double lambda, float* out);

}  // namespace loom::data::layout
