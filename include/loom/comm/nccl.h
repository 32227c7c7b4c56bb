// The NCCL backend: collectives on CUDA tensors, bootstrapped through a Store.
//
// Built when Loom is configured with CUDA (LOOM_WITH_CUDA); otherwise nccl_available() is
// false and new_nccl_group throws InvalidArgument saying so. Each group owns a communicator
// and a CUDA stream. An op waits (on the GPU) for the caller's current compute stream, runs on
// the group's stream, and Work::wait() makes the compute stream wait for the op, so results are
// ordered without host synchronisation. Communicators are non-blocking: a wait past its
// deadline aborts the communicator (ncclCommAbort) and throws Timeout instead of hanging; the
// group is unusable afterwards.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

#include "loom/comm/group.h"
#include "loom/comm/store.h"
#include "loom/visibility.h"

namespace loom::comm {

struct NcclOptions {
  int device = 0;  // the CUDA device this rank uses (usually the local rank)
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(120)};
  size_t flight_capacity = 2048;
  std::filesystem::path flight_dump_dir;  // rank_<r>.json is written here on a timeout ("" = no)
  std::string name = "world";
};

// True when this Loom was built with CUDA and NCCL.
LOOM_API bool nccl_available();

// Every rank calls it with the same store, which must outlive the group (subgroups bootstrap
// through it). Rank 0 publishes the NCCL unique id under "nccl/<name>#<g>/unique_id", where g
// counts this rank's groups of that name, so a reused name never reads an old id. Arguments
// are checked as for Gloo (InvalidArgument), and so are every op's (the same shared checks,
// with tensors on cuda:<device> instead of the CPU).
LOOM_API std::unique_ptr<Group> new_nccl_group(Store& store, int rank, int size,
                                               const NcclOptions& options = {});

}  // namespace loom::comm
