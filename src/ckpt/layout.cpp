// Regions and file layout of a State (see layout.h).
#include "ckpt/layout.h"

#include <set>

#include "ckpt/manifest.h"
#include "loom/error.h"

namespace loom::ckpt {
namespace {

int64_t product(const std::vector<int64_t>& dims, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < dims.size(); ++i) n *= dims[i];
  return n;
}

std::string dims_text(at::IntArrayRef dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// One run, or none when empty.
std::vector<Run> runs_of(int64_t begin, int64_t end) {
  if (begin == end) return {};
  return {{begin, end}};
}

// A kBlock piece's runs: the box's rows of contiguous elements in the view, row-major, cut to
// elements [begin, end) of the box and joined where they touch.
Region block_region(const TensorEntry& e) {
  const Sharding& s = e.sharding;
  const std::vector<int64_t>& view = s.view.empty() ? s.global_shape : s.view;
  const size_t dims = view.size();
  const int64_t box = product(s.sizes);
  bool fits = product(view) == product(s.global_shape) && s.offsets.size() == dims &&
              s.sizes.size() == dims && 0 <= s.begin && s.begin <= s.end && s.end <= box &&
              e.tensor.numel() == s.end - s.begin;
  for (size_t d = 0; fits && d < dims; ++d)
    fits = s.offsets[d] >= 0 && s.sizes[d] >= 0 && s.offsets[d] + s.sizes[d] <= view[d];
  LOOM_CHECK(fits, InvalidArgument, "checkpoint tensor \"", e.name, "\": a block at offsets ",
             dims_text(s.offsets), " of sizes ", dims_text(s.sizes), " (elements [", s.begin, ", ",
             s.end, ") of it) of global shape ", dims_text(s.global_shape), " viewed as ",
             dims_text(view), " cannot be a tensor of ", e.tensor.numel(),
             " elements; it needs one offset and size per view dim inside the view, a view of as "
             "many elements as the global shape, and end - begin elements");
  Region region{s.global_shape, {}};
  if (s.begin == s.end) return region;
  // The last dim where the box is narrower than the view: each run spans it and every dim
  // after it (whole in the view), and there is one run per index of the dims before it.
  size_t cut = 0;
  for (size_t d = 0; d < dims; ++d)
    if (s.sizes[d] != view[d]) cut = d;
  std::vector<int64_t> stride(dims, 1);  // the view's row-major strides
  for (size_t d = dims; d-- > 1;) stride[d - 1] = stride[d] * view[d];
  const int64_t run = dims == 0 ? 1 : s.sizes[cut] * stride[cut];
  std::vector<int64_t> index(cut, 0);  // over dims [0, cut)
  for (int64_t local = 0; local < box; local += run) {
    int64_t start = dims == 0 ? 0 : s.offsets[cut] * stride[cut];
    for (size_t d = 0; d < cut; ++d) start += (s.offsets[d] + index[d]) * stride[d];
    const int64_t lo = std::max(local, s.begin), hi = std::min(local + run, s.end);
    if (lo < hi) {
      const Run piece{start + (lo - local), start + (hi - local)};
      if (!region.runs.empty() && region.runs.back().end == piece.begin) {
        region.runs.back().end = piece.end;
      } else {
        region.runs.push_back(piece);
      }
    }
    for (size_t d = cut; d-- > 0;) {  // the next index, last dim fastest
      if (++index[d] < s.sizes[d]) break;
      index[d] = 0;
    }
  }
  return region;
}

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

const char* kind_name(Sharding::Kind kind) {
  switch (kind) {
    case Sharding::Kind::kReplicated:
      return "replicated";
    case Sharding::Kind::kRows:
      return "rows";
    case Sharding::Kind::kFlat:
      return "flat";
    case Sharding::Kind::kBlock:
      return "block";
  }
  return "?";
}

int64_t Region::numel() const {
  int64_t n = 0;
  for (const Run& r : runs) n += r.end - r.begin;
  return n;
}

Sharding Sharding::block(std::vector<int64_t> global_shape, std::vector<int64_t> offsets,
                         std::vector<int64_t> sizes, std::vector<int64_t> view) {
  Sharding s;
  s.kind = Kind::kBlock;
  s.global_shape = std::move(global_shape);
  s.end = product(sizes);
  s.view = std::move(view);
  s.offsets = std::move(offsets);
  s.sizes = std::move(sizes);
  return s;
}

Sharding Sharding::part(int64_t lo, int64_t hi, const std::vector<int64_t>& shape) const {
  LOOM_CHECK(0 <= lo && lo <= hi, InvalidArgument, "Sharding::part: [", lo, ", ", hi,
             ") is not a range");
  Sharding s;
  switch (kind) {
    case Kind::kReplicated:
      s = flat(shape, lo, hi);
      break;
    case Kind::kRows: {
      const int64_t row = product(global_shape, 1);
      s = flat(global_shape, begin * row + lo, begin * row + hi);
      break;
    }
    case Kind::kFlat:
      s = flat(global_shape, begin + lo, begin + hi);
      break;
    case Kind::kBlock:
      s = *this;
      s.begin = begin + lo;
      s.end = begin + hi;
      break;
  }
  const int64_t n = kind == Kind::kReplicated ? product(shape) : end - begin;
  LOOM_CHECK(hi <= n, InvalidArgument, "Sharding::part: [", lo, ", ", hi, ") is beyond the ", n,
             " elements of the piece");
  s.written = written;
  return s;
}

Region region_of(const TensorEntry& e) {
  const at::Tensor& t = e.tensor;
  const Sharding& s = e.sharding;
  LOOM_CHECK(t.defined(), InvalidArgument, "checkpoint tensor \"", e.name, "\" is undefined");
  for (int64_t d : s.global_shape)
    LOOM_CHECK(d >= 0, InvalidArgument, "checkpoint tensor \"", e.name,
               "\": global_shape has a negative dimension");
  switch (s.kind) {
    case Sharding::Kind::kReplicated:
      return {t.sizes().vec(), runs_of(0, t.numel())};
    case Sharding::Kind::kRows: {
      const auto& g = s.global_shape;
      LOOM_CHECK(!g.empty() && t.dim() == static_cast<int64_t>(g.size()) && 0 <= s.begin &&
                     s.begin <= s.end && s.end <= g[0] && t.size(0) == s.end - s.begin &&
                     std::equal(g.begin() + 1, g.end(), t.sizes().begin() + 1),
                 InvalidArgument, "checkpoint tensor \"", e.name, "\": a rows piece [", s.begin,
                 ", ", s.end, ") of global shape ", dims_text(g), " cannot be a tensor of shape ",
                 dims_text(t.sizes()),
                 "; it needs end - begin rows, the other dims of the global shape, and "
                 "0 <= begin <= end <= rows");
      const int64_t row = product(g, 1);
      return {g, runs_of(s.begin * row, s.end * row)};
    }
    case Sharding::Kind::kFlat: {
      const auto& g = s.global_shape;
      LOOM_CHECK(
          0 <= s.begin && s.begin <= s.end && s.end <= product(g) && t.numel() == s.end - s.begin,
          InvalidArgument, "checkpoint tensor \"", e.name, "\": a flat piece [", s.begin, ", ",
          s.end, ") of global shape ", dims_text(g), " (", product(g),
          " elements) cannot be a tensor of ", t.numel(),
          " elements; it needs end - begin elements and 0 <= begin <= end <= numel");
      return {g, runs_of(s.begin, s.end)};
    }
    case Sharding::Kind::kBlock:
      return block_region(e);
  }
  throw InvalidArgument(detail::concat("checkpoint tensor \"", e.name, "\": unknown sharding"));
}

bool writes(const Sharding& sharding, int rank) {
  return sharding.kind == Sharding::Kind::kReplicated ? rank == 0 : sharding.written;
}

FilePlan plan_file(const State& state, int rank) {
  FilePlan plan;
  std::set<std::string> names;
  for (const auto& [name, text] : state.blobs)
    LOOM_CHECK(names.insert(name).second, InvalidArgument, "checkpoint blob name \"", name,
               "\" is used twice");
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const TensorEntry& e = state.tensors[i];
    LOOM_CHECK(!e.name.empty(), InvalidArgument, "a checkpoint tensor has an empty name");
    LOOM_CHECK(names.insert(e.name).second, InvalidArgument, "checkpoint name \"", e.name,
               "\" is used twice (names are unique across tensors and blobs)");
    Region region = region_of(e);
    dtype_name(e.tensor.scalar_type());  // InvalidArgument for dtypes checkpoints cannot hold
    if (!writes(e.sharding, rank) || region.runs.empty()) continue;
    const uint64_t bytes = static_cast<uint64_t>(region.numel()) * e.tensor.element_size();
    const uint64_t offset = align_up(plan.file_bytes, bytes >= (64u << 10) ? 4096 : 64);
    plan.pieces.push_back({i, std::move(region), offset, bytes});
    plan.file_bytes = offset + bytes;
  }
  return plan;
}

}  // namespace loom::ckpt
