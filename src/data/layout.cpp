// Record layouts: their schema and per-record rules, and the returns and advantages of
// episodes.
#include "data/layout.h"

#include <cstring>

namespace loom::data::layout {
namespace {

int index_of(const std::vector<Field>& schema, const char* name) {
  for (size_t i = 0; i < schema.size(); ++i) {
    if (schema[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

// "" or why field `name` is not a ragged tensor of one of `dtypes` (any dtype when empty).
std::string need_ragged(const std::vector<Field>& schema, const char* name,
                        const std::vector<std::string>& dtypes, bool required,
                        const char* layout_name) {
  const int i = index_of(schema, name);
  if (i < 0) {
    return required ? std::string("the ") + layout_name + " layout needs a field '" + name + "'"
                    : "";
  }
  const Field& f = schema[static_cast<size_t>(i)];
  std::string want;
  for (const std::string& d : dtypes) want += (want.empty() ? "" : " or ") + d;
  bool dtype_ok = dtypes.empty();
  for (const std::string& d : dtypes) dtype_ok = dtype_ok || f.dtype == d;
  if (f.type != FieldType::kTensor || !f.ragged || !dtype_ok) {
    return std::string("field '") + name + "' of the " + layout_name + " layout must be a ragged " +
           (want.empty() ? "" : want + " ") + "tensor";
  }
  return "";
}

}  // namespace

std::string check_schema(RecordLayout layout, const std::vector<Field>& schema) {
  for (const Field& f : schema) {
    if (f.ragged && (f.type != FieldType::kTensor || !f.shape.empty())) {
      return "field '" + f.name + "' is ragged but is not a tensor with a per-record shape";
    }
  }
  std::string bad;
  auto need = [&](const char* name, const std::vector<std::string>& dtypes, bool required,
                  const char* layout_name) {
    if (bad.empty()) bad = need_ragged(schema, name, dtypes, required, layout_name);
  };
  switch (layout) {
    case RecordLayout::kPlain:
      break;
    case RecordLayout::kMultimodal: {
      need("tokens", {"int32", "int64"}, true, "multimodal");
      need("image_positions", {"int64"}, true, "multimodal");
      const int images = index_of(schema, "images");
      if (bad.empty() &&
          (images < 0 || schema[static_cast<size_t>(images)].type != FieldType::kImages)) {
        bad = "the multimodal layout needs a field 'images' of type images";
      }
      break;
    }
    case RecordLayout::kEpisodes:
      need("observation", {}, true, "episodes");
      need("action", {}, true, "episodes");
      need("reward", {"float32"}, true, "episodes");
      need("done", {"uint8", "bool"}, true, "episodes");
      need("log_prob", {"float32"}, false, "episodes");
      need("value", {"float32"}, false, "episodes");
      break;
  }
  return bad;
}

EpisodeFields episode_fields(const std::vector<Field>& schema) {
  return {index_of(schema, "observation"), index_of(schema, "action"),   index_of(schema, "reward"),
          index_of(schema, "done"),        index_of(schema, "log_prob"), index_of(schema, "value")};
}

MultimodalFields multimodal_fields(const std::vector<Field>& schema) {
  return {index_of(schema, "tokens"), index_of(schema, "images"),
          index_of(schema, "image_positions")};
}

std::string check_record(RecordLayout layout, const std::vector<Field>& schema,
                         const format::FieldView* views) {
  if (layout == RecordLayout::kEpisodes) {
    const EpisodeFields f = episode_fields(schema);
    const int64_t length = episode_length(f, views);
    if (length < 1) return "the episode has no steps (field 'reward' is empty)";
    for (const int one_d : {f.reward, f.done, f.log_prob, f.value}) {
      if (one_d >= 0 && views[one_d].ndim != 1) {
        return "field '" + schema[static_cast<size_t>(one_d)].name +
               "' must hold one value per step (shape [T]); it has " +
               std::to_string(views[one_d].ndim) + " dimensions";
      }
    }
    for (size_t i = 0; i < schema.size(); ++i) {
      if (!schema[i].ragged || views[i].dims[0] == length) continue;
      return "field '" + schema[i].name + "' has " + std::to_string(views[i].dims[0]) +
             " steps but field 'reward' has " + std::to_string(length) +
             "; every per-step field of an episode has one entry per step";
    }
  } else if (layout == RecordLayout::kMultimodal) {
    const MultimodalFields f = multimodal_fields(schema);
    for (const int one_d : {f.tokens, f.positions}) {
      if (views[one_d].ndim != 1) {
        return "field '" + schema[static_cast<size_t>(one_d)].name + "' must be 1-D; it has " +
               std::to_string(views[one_d].ndim) + " dimensions";
      }
    }
    const format::FieldView& positions = views[f.positions];
    const int64_t images = views[f.images].integer;
    const int64_t tokens = views[f.tokens].dims[0];
    if (positions.ndim != 1 || positions.dims[0] != images) {
      return "field 'image_positions' holds " +
             std::to_string(positions.ndim == 1 ? positions.dims[0] : -1) +
             " positions but field 'images' holds " + std::to_string(images) +
             " images; give one position per image";
    }
    int64_t previous = 0;
    for (int64_t k = 0; k < images; ++k) {
      int64_t at;
      std::memcpy(&at, positions.data + 8 * k, 8);
      if (at < previous || at > tokens) {
        return "field 'image_positions' entry " + std::to_string(k) + " is " + std::to_string(at) +
               "; positions must be non-decreasing and at most the " + std::to_string(tokens) +
               " tokens";
      }
      previous = at;
    }
  }
  return "";
}

void discounted_returns(const float* reward, const uint8_t* done, int64_t length, double gamma,
                        float* out) {
  double g = 0;
  for (int64_t t = length - 1; t >= 0; --t) {
    g = static_cast<double>(reward[t]) + (done[t] ? 0.0 : gamma * g);
    out[t] = static_cast<float>(g);
  }
}

void gae_advantages(const float* reward, const uint8_t* done, const float* value, int64_t length,
                    double gamma, double lambda, float* out) {
  double next_value = 0, a = 0;
  for (int64_t t = length - 1; t >= 0; --t) {
    const double keep = done[t] ? 0.0 : 1.0;
    const double delta =
        static_cast<double>(reward[t]) + gamma * keep * next_value - static_cast<double>(value[t]);
    a = delta + gamma * lambda * keep * a;
    out[t] = static_cast<float>(a);
    next_value = static_cast<double>(value[t]);
  }
}

}  // namespace loom::data::layout
