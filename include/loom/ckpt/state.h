// What a checkpoint holds: named tensors, each with how this rank's piece relates to the
// global tensor, plus named JSON blobs (trainer state, reader state, RNG, config).
//
// Saving: every rank describes its own pieces. Loading: every rank builds a State whose
// tensors are already allocated with the pieces it wants now (its new sharding, possibly at
// another world size) and the checkpointer fills them in place, reading only those bytes.
// Areas that own sharded state (parallel::, data::) describe it with these types; the
// checkpointer stores whatever they describe and knows nothing of them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::ckpt {

// How a rank's tensor is a piece of one global tensor.
struct Sharding {
  enum class Kind {
    kReplicated,  // every rank holds the whole tensor; it is written once, by rank 0
    kRows,        // this rank holds rows [begin, end) (dim 0) of a tensor of global_shape
    kFlat,        // this rank holds elements [begin, end) of the flattened global tensor
                  // (a ZeRO shard of a flat buffer); global_shape is the global tensor's shape
    // This rank holds a box of the global tensor viewed as `view` (empty: global_shape): along
    // view dim d, indices [offsets[d], offsets[d] + sizes[d]); its tensor holds elements
    // [begin, end) of the box in row-major order (all of it: [0, product of sizes)). A column
    // shard of a row-parallel weight [out, in] is block({out, in}, {0, c0}, {out, c1 - c0}); a
    // rank's heads of a fused [q; k; v] weight [3 C, C] are a box of the view [3, C, C].
    kBlock,
  };
  Kind kind = Kind::kReplicated;
  std::vector<int64_t> global_shape;  // empty for kReplicated: the tensor's own shape is global
  int64_t begin = 0;                  // kRows: first row; kFlat, kBlock: first element
  int64_t end = 0;                    // one past the last; begin <= end; pieces may be empty
  std::vector<int64_t> view;          // kBlock: the shape the box is cut from (empty: global)
  std::vector<int64_t> offsets;       // kBlock: the box's first index along each view dim
  std::vector<int64_t> sizes;         // kBlock: its extent along each view dim
  // Whether this rank writes its piece. false where another rank holds the same piece and
  // writes it (tensor-parallel ranks holding one replicated LayerNorm: only the first writes);
  // the piece is still loaded. kReplicated tensors are written by rank 0 whatever this says.
  bool written = true;

  static Sharding replicated() { return {}; }
  static Sharding rows(std::vector<int64_t> global_shape, int64_t begin, int64_t end) {
    return {Kind::kRows, std::move(global_shape), begin, end};
  }
  static Sharding flat(std::vector<int64_t> global_shape, int64_t begin, int64_t end) {
    return {Kind::kFlat, std::move(global_shape), begin, end};
  }
  // The whole box; `view` empty: boxes of global_shape itself.
  LOOM_API static Sharding block(std::vector<int64_t> global_shape, std::vector<int64_t> offsets,
                                 std::vector<int64_t> sizes, std::vector<int64_t> view = {});
  // Elements [begin, end) of this piece in its own row-major order, as a piece of the same
  // global tensor: how a ZeRO or FSDP shard of a tensor-parallel piece is described. For
  // kReplicated, `shape` is the tensor's (the global) shape. `written` is kept.
  LOOM_API Sharding part(int64_t begin, int64_t end, const std::vector<int64_t>& shape = {}) const;
};

// One named tensor of a State. The tensor must be contiguous; for kFlat it is 1-D with
// end - begin elements, for kRows its dim 0 has end - begin rows and its other dims match
// global_shape.
struct TensorEntry {
  std::string name;
  at::Tensor tensor;
  Sharding sharding;
};

// A checkpoint's content, as one rank sees it. Names are unique across tensors and blobs.
// A plain value; not thread-safe.
struct LOOM_API State {
  std::vector<TensorEntry> tensors;
  std::map<std::string, std::string> blobs;  // name -> JSON text

  void add(std::string name, at::Tensor tensor, Sharding sharding = Sharding::replicated()) {
    tensors.push_back({std::move(name), std::move(tensor), std::move(sharding)});
  }
};

}  // namespace loom::ckpt
