// How a State's tensors map to element ranges of global tensors and to byte ranges of this
// rank's data file. Shared by save (planning the file) and load (finding what to read).
// Private to Loom.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/ckpt/state.h"

namespace loom::ckpt {

// The part of a global tensor one TensorEntry holds: runs of elements of the flattened global
// tensor, in the order the entry's tensor holds them (one run for every kind but kBlock).
struct Run {
  int64_t begin = 0;
  int64_t end = 0;
};
struct Region {
  std::vector<int64_t> global_shape;
  std::vector<Run> runs;  // disjoint, non-empty, increasing

  int64_t numel() const;
};

// Checks that entry's tensor agrees with its sharding (InvalidArgument naming the tensor) and
// returns the region it holds.
Region region_of(const TensorEntry& entry);

const char* kind_name(Sharding::Kind kind);

// Whether `rank` writes a piece of this sharding (rank 0 for replicated ones, else `written`).
bool writes(const Sharding& sharding, int rank);

// One entry this rank writes: entry `entry` of the State into bytes [offset, offset + bytes)
// of its data file, its region's runs one after the other (a manifest piece each).
struct PlannedPiece {
  size_t entry = 0;
  Region region;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct FilePlan {
  std::vector<PlannedPiece> pieces;
  uint64_t file_bytes = 0;
};

// Lays out the pieces `rank` writes: every non-empty piece whose sharding is `written`, and
// replicated tensors on rank 0 only. Pieces of 64 KiB or more start at 4 KiB boundaries, smaller
// ones at 64 B. Also validates the whole State (unique names, shardings, dtypes): InvalidArgument.
FilePlan plan_file(const State& state, int rank);

}  // namespace loom::ckpt
