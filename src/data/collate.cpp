// Record collation: plain fields stacked, ragged tensors padded, images decoded and padded,
// episodes given their returns and advantages.
#include "data/collate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "data/image_codec.h"
#include "data/layout.h"
#include "loom/error.h"
#include "util/dtype.h"

namespace loom::data::collate {
namespace {

at::ScalarType scalar_type(const std::string& dtype) {
  const std::optional<at::ScalarType> type = util::dtype_of(dtype);
  LOOM_CHECK(type.has_value(), CorruptData, "the dataset's manifest names tensor dtype '", dtype,
             "', which this Loom does not read");
  return *type;
}

std::string shape_text(const format::FieldView& v) {
  std::string out = "[";
  for (uint32_t i = 0; i < v.ndim; ++i) out += (i ? ", " : "") + std::to_string(v.dims[i]);
  return out + "]";
}

// The dims of a view after the first are equal.
bool same_trailing(const format::FieldView& a, const format::FieldView& b) {
  return a.ndim == b.ndim && std::equal(a.dims + 1, a.dims + a.ndim, b.dims + 1);
}

// One encoded image of a row, and its decoded size once probed.
struct Encoded {
  size_t row = 0;
  int64_t slot = 0;  // its place in the row's list (0 for an image field)
  const uint8_t* data = nullptr;
  size_t size = 0;
  image::Info info;
};

class Collator {
 public:
  Collator(const Manifest& m, const ReaderOptions& o, const std::vector<Row>& rows,
           const WhereFn& where, Batch& batch)
      : m_(m),
        o_(o),
        rows_(rows),
        where_(where),
        batch_(batch),
        n_(static_cast<int64_t>(rows.size())) {
    transitions_ = !rows.empty() && rows[0].step >= 0;
  }

  void run() {
    for (size_t f = 0; f < m_.schema.size(); ++f) field(f);
    if (m_.layout == RecordLayout::kEpisodes) episodes();
  }

 private:
  const format::FieldView& view(size_t r, size_t f) const { return rows_[r].views[f]; }

  void field(size_t f) {
    const Field& field = m_.schema[f];
    switch (field.type) {
      case FieldType::kInt: {
        at::Tensor t = at::empty({n_}, at::kLong);
        for (int64_t r = 0; r < n_; ++r) t.data_ptr<int64_t>()[r] = view(r, f).integer;
        batch_.tensors[field.name] = t;
        break;
      }
      case FieldType::kFloat: {
        at::Tensor t = at::empty({n_}, at::kDouble);
        for (int64_t r = 0; r < n_; ++r) t.data_ptr<double>()[r] = view(r, f).real;
        batch_.tensors[field.name] = t;
        break;
      }
      case FieldType::kText:
      case FieldType::kBytes: {
        auto& out = batch_.strings[field.name];
        for (int64_t r = 0; r < n_; ++r) {
          out.emplace_back(reinterpret_cast<const char*>(view(r, f).data), view(r, f).size);
        }
        break;
      }
      case FieldType::kTensor:
        if (!field.ragged) {
          stacked(f);
        } else if (transitions_) {
          steps(f);
        } else {
          padded(f);
        }
        break;
      case FieldType::kImage:
      case FieldType::kImages:
        images(f);
        break;
    }
  }

  // Equal shapes, stacked.
  void stacked(size_t f) {
    const Field& field = m_.schema[f];
    const format::FieldView& first = view(0, f);
    std::vector<int64_t> full{n_};
    full.insert(full.end(), first.dims, first.dims + first.ndim);
    at::Tensor t = at::empty(full, scalar_type(field.dtype));
    auto* out = static_cast<uint8_t*>(t.data_ptr());
    const size_t row_bytes = first.size;
    for (int64_t r = 0; r < n_; ++r) {
      LOOM_CHECK(view(r, f).same_shape(first), InvalidArgument, "tensor field '", field.name,
                 "' has different shapes within one batch (samples ", batch_.indices[0], " and ",
                 batch_.indices[r], "); only equal shapes can be stacked");
      std::memcpy(out + r * row_bytes, view(r, f).data, row_bytes);
    }
    batch_.tensors[field.name] = t;
  }

  // Ragged: the first dimension padded to the longest, with a mask.
  void padded(size_t f) {
    const Field& field = m_.schema[f];
    const format::FieldView& first = view(0, f);
    int64_t longest = 0;
    for (int64_t r = 0; r < n_; ++r) {
      LOOM_CHECK(same_trailing(view(r, f), first), InvalidArgument, "ragged field '", field.name,
                 "' has shapes ", shape_text(first), " and ", shape_text(view(r, f)),
                 " within one batch (samples ", batch_.indices[0], " and ", batch_.indices[r],
                 "); only the first dimension may differ");
      longest = std::max(longest, view(r, f).dims[0]);
    }
    std::vector<int64_t> full{n_, longest};
    full.insert(full.end(), first.dims + 1, first.dims + first.ndim);
    at::Tensor t = at::zeros(full, scalar_type(field.dtype));
    at::Tensor mask = at::zeros({n_, longest}, at::kBool);
    const size_t row_bytes =
        static_cast<size_t>(t.numel() / std::max<int64_t>(n_, 1)) * t.element_size();
    auto* out = static_cast<uint8_t*>(t.data_ptr());
    for (int64_t r = 0; r < n_; ++r) {
      std::memcpy(out + r * row_bytes, view(r, f).data, view(r, f).size);
      std::fill_n(mask.data_ptr<bool>() + r * longest, view(r, f).dims[0], true);
    }
    batch_.tensors[field.name] = t;
    batch_.tensors[field.name + "_mask"] = mask;
  }

  // Transitions: each row's step of a per-step field.
  void steps(size_t f) {
    const Field& field = m_.schema[f];
    const format::FieldView& first = view(0, f);
    std::vector<int64_t> full{n_};
    full.insert(full.end(), first.dims + 1, first.dims + first.ndim);
    at::Tensor t = at::empty(full, scalar_type(field.dtype));
    const size_t step_bytes =
        static_cast<size_t>(t.numel() / std::max<int64_t>(n_, 1)) * t.element_size();
    auto* out = static_cast<uint8_t*>(t.data_ptr());
    for (int64_t r = 0; r < n_; ++r) {
      LOOM_CHECK(same_trailing(view(r, f), first), InvalidArgument, "ragged field '", field.name,
                 "' has shapes ", shape_text(first), " and ", shape_text(view(r, f)),
                 " within one batch (samples ", batch_.indices[0], " and ", batch_.indices[r],
                 "); only the first dimension may differ");
      LOOM_CHECK(rows_[r].step < view(r, f).dims[0], CorruptData, where_(r), ": field '",
                 field.name, "' has ", view(r, f).dims[0], " steps, fewer than step ",
                 rows_[r].step, " needs; run `loom data verify`");
      std::memcpy(out + r * step_bytes, view(r, f).data + rows_[r].step * step_bytes, step_bytes);
    }
    batch_.tensors[field.name] = t;
  }

  void images(size_t f) {
    const Field& field = m_.schema[f];
    const bool list = field.type == FieldType::kImages;
    std::vector<Encoded> all;
    int64_t slots = list ? 0 : 1, height = 0, width = 0, channels = o_.image_channels;
    for (int64_t r = 0; r < n_; ++r) {
      const format::FieldView& v = view(r, f);
      std::vector<std::pair<const uint8_t*, size_t>> items;
      if (list) {
        items = format::list_items(v);
      } else {
        items.emplace_back(v.data, v.size);
      }
      slots = std::max(slots, static_cast<int64_t>(items.size()));
      for (size_t k = 0; k < items.size(); ++k) {
        Encoded e{
            static_cast<size_t>(r), static_cast<int64_t>(k), items[k].first, items[k].second, {}};
        const std::string bad = image::probe(e.data, e.size, &e.info);
        LOOM_CHECK(bad.empty(), CorruptData, where_(r), ": field '", field.name, "'",
                   list ? " image " + std::to_string(k) : "", " does not decode: ", bad);
        height = std::max(height, e.info.height);
        width = std::max(width, e.info.width);
        if (o_.image_channels == 0) {
          LOOM_CHECK(channels == 0 || channels == e.info.channels, InvalidArgument, "image field '",
                     field.name, "' has images of ", channels, " and ", e.info.channels,
                     " channels within one batch (samples ",
                     batch_.indices[all.empty() ? 0 : all[0].row], " and ", batch_.indices[r],
                     "); set ReaderOptions::image_channels (--image-channels) to convert them");
          channels = e.info.channels;
        }
        all.push_back(e);
      }
    }
    std::vector<int64_t> shape = list ? std::vector<int64_t>{n_, slots, height, width, channels}
                                      : std::vector<int64_t>{n_, height, width, channels};
    at::Tensor t = at::zeros(shape, at::kByte);
    std::vector<int64_t> size_shape =
        list ? std::vector<int64_t>{n_, slots, 2} : std::vector<int64_t>{n_, 2};
    at::Tensor sizes = at::zeros(size_shape, at::kLong);
    at::Tensor mask = at::zeros({n_, slots}, at::kBool);
    uint8_t* out = t.data_ptr<uint8_t>();
    std::vector<uint8_t> pixels, converted;
    for (const Encoded& e : all) {
      const int64_t h = e.info.height, w = e.info.width, c = e.info.channels;
      pixels.resize(static_cast<size_t>(h * w * c));
      const std::string bad = image::decode(e.data, e.size, e.info, pixels.data());
      LOOM_CHECK(bad.empty(), CorruptData, where_(e.row), ": field '", field.name, "'",
                 list ? " image " + std::to_string(e.slot) : "", " does not decode: ", bad);
      const uint8_t* src = pixels.data();
      if (c != channels) {
        converted.resize(static_cast<size_t>(h * w * channels));
        convert_channels(pixels.data(), c, converted.data(), channels, h * w);
        src = converted.data();
      }
      const int64_t slot = static_cast<int64_t>(e.row) * slots + e.slot;
      uint8_t* dst = out + slot * height * width * channels;
      for (int64_t y = 0; y < h; ++y) {
        std::memcpy(dst + y * width * channels, src + y * w * channels,
                    static_cast<size_t>(w * channels));
      }
      sizes.data_ptr<int64_t>()[2 * slot] = h;
      sizes.data_ptr<int64_t>()[2 * slot + 1] = w;
      mask.data_ptr<bool>()[slot] = true;
    }
    batch_.tensors[field.name] = t;
    batch_.tensors[field.name + "_size"] = sizes;
    if (list) batch_.tensors[field.name + "_mask"] = mask;
  }

  // Returns (and advantages, with a value field) of each row's episode.
  void episodes() {
    const layout::EpisodeFields f = layout::episode_fields(m_.schema);
    int64_t longest = 0;
    for (int64_t r = 0; r < n_; ++r) {
      const std::string bad = layout::check_record(m_.layout, m_.schema, rows_[r].views);
      LOOM_CHECK(bad.empty(), CorruptData, where_(r), ": ", bad, "; run `loom data verify`");
      longest = std::max(longest, layout::episode_length(f, rows_[r].views));
    }
    const bool has_value = f.value >= 0;
    at::Tensor returns =
        transitions_ ? at::zeros({n_}, at::kFloat) : at::zeros({n_, longest}, at::kFloat);
    at::Tensor advantages = at::zeros_like(returns);
    // A record's fields sit at any byte offset in the shard, so reward and value are copied
    // into aligned buffers before they are read as floats.
    std::vector<float> reward, value, g, a;
    for (int64_t r = 0; r < n_; ++r) {
      const format::FieldView* v = rows_[r].views;
      const int64_t length = layout::episode_length(f, v);
      const size_t steps = static_cast<size_t>(length);
      reward.resize(steps);
      g.resize(steps);
      a.resize(steps);
      std::memcpy(reward.data(), v[f.reward].data, steps * sizeof(float));
      const uint8_t* done = v[f.done].data;
      layout::discounted_returns(reward.data(), done, length, o_.gamma, g.data());
      if (has_value) {
        value.resize(steps);
        std::memcpy(value.data(), v[f.value].data, steps * sizeof(float));
        layout::gae_advantages(reward.data(), done, value.data(), length, o_.gamma, o_.gae_lambda,
                               a.data());
      }
      if (transitions_) {
        returns.data_ptr<float>()[r] = g[static_cast<size_t>(rows_[r].step)];
        advantages.data_ptr<float>()[r] = a[static_cast<size_t>(rows_[r].step)];
      } else {
        std::copy(g.begin(), g.end(), returns.data_ptr<float>() + r * longest);
        std::copy(a.begin(), a.end(), advantages.data_ptr<float>() + r * longest);
      }
    }
    batch_.tensors["return"] = returns;
    if (has_value) batch_.tensors["advantage"] = advantages;
    if (transitions_) {
      at::Tensor episode = at::empty({n_}, at::kLong), step = at::empty({n_}, at::kLong);
      for (int64_t r = 0; r < n_; ++r) {
        episode.data_ptr<int64_t>()[r] = static_cast<int64_t>(rows_[r].episode);
        step.data_ptr<int64_t>()[r] = rows_[r].step;
      }
      batch_.tensors["episode"] = episode;
      batch_.tensors["step"] = step;
    }
  }

  const Manifest& m_;
  const ReaderOptions& o_;
  const std::vector<Row>& rows_;
  const WhereFn& where_;
  Batch& batch_;
  const int64_t n_;
  bool transitions_ = false;
};

}  // namespace

void records(const Manifest& manifest, const ReaderOptions& options, const std::vector<Row>& rows,
             const WhereFn& where, Batch& batch) {
  Collator(manifest, options, rows, where, batch).run();
}

void convert_channels(const uint8_t* in, int64_t from, uint8_t* out, int64_t to, int64_t pixels) {
  const bool in_color = from >= 3, in_alpha = from == 2 || from == 4;
  for (int64_t p = 0; p < pixels; ++p, in += from, out += to) {
    const uint8_t gray =
        in_color ? static_cast<uint8_t>((299 * in[0] + 587 * in[1] + 114 * in[2] + 500) / 1000)
                 : in[0];
    const uint8_t alpha = in_alpha ? in[from - 1] : 255;
    if (to <= 2) {
      out[0] = gray;
    } else {
      for (int k = 0; k < 3; ++k) out[k] = in_color ? in[k] : in[0];
    }
    if (to == 2 || to == 4) out[to - 1] = alpha;
  }
}

}  // namespace loom::data::collate
