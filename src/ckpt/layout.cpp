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
  }
  return "?";
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
      return {t.sizes().vec(), 0, t.numel()};
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
      return {g, s.begin * row, s.end * row};
    }
    case Sharding::Kind::kFlat: {
      const auto& g = s.global_shape;
      LOOM_CHECK(
          0 <= s.begin && s.begin <= s.end && s.end <= product(g) && t.numel() == s.end - s.begin,
          InvalidArgument, "checkpoint tensor \"", e.name, "\": a flat piece [", s.begin, ", ",
          s.end, ") of global shape ", dims_text(g), " (", product(g),
          " elements) cannot be a tensor of ", t.numel(),
          " elements; it needs end - begin elements and 0 <= begin <= end <= numel");
      return {g, s.begin, s.end};
    }
  }
  throw InvalidArgument(detail::concat("checkpoint tensor \"", e.name, "\": unknown sharding"));
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
    const bool writes = e.sharding.kind != Sharding::Kind::kReplicated || rank == 0;
    if (!writes || region.begin == region.end) continue;
    const uint64_t bytes =
        static_cast<uint64_t>(region.end - region.begin) * e.tensor.element_size();
    const uint64_t offset = align_up(plan.file_bytes, bytes >= (64u << 10) ? 4096 : 64);
    plan.pieces.push_back({i, std::move(region), offset, bytes});
    plan.file_bytes = offset + bytes;
  }
  return plan;
}

}  // namespace loom::ckpt
