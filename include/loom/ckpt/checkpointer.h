// Asynchronous, sharded, checksummed checkpoints with an atomic commit.
//
//   loom::ckpt::Checkpointer ckpt(store, {.dir = "runs/x/ckpt", .rank = r, .world_size = w,
//                                         .keep_last = 3});
//   loom::ckpt::State state;
//   state.add("model.weight", weight);                                   // replicated
//   state.add("adam.m", m_shard, loom::ckpt::Sharding::flat({n}, b, e));  // a ZeRO shard
//   auto handle = ckpt.save(step, state);   // copies into staging memory, returns
//   ...                                     // training continues; one thread writes
//   handle.wait(std::chrono::minutes(5));   // raises the save's error, on every rank
//
// Layout (docs/checkpoint.md): ckpt_dir/step_00001000/ holds one data file per rank and
// manifest.json, written by rank 0 (temp file, fsync, rename, directory fsync) only after
// every rank reported its file fsynced through the Store. A directory without a manifest is
// not a checkpoint: it is never `latest` and retention removes it.
//
// Every rank constructs one Checkpointer over the same directory and the same Store and calls
// save() for the same steps in the same order. Load needs no other rank: each rank reads the
// byte ranges of its own pieces, whatever the world size at save time.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/ckpt/state.h"
#include "loom/visibility.h"

namespace spdlog {
class logger;
}

namespace loom::comm {
class Store;
}

namespace loom::ckpt {

class Storage;  // the private storage seam (src/ckpt/storage.h); tests inject faults with it

struct CheckpointerOptions {
  std::filesystem::path dir;  // the checkpoint directory; created when missing
  int rank = 0;               // this rank, in [0, world_size)
  int world_size = 1;         // ranks saving together
  // Retention, applied by rank 0's writer thread after each commit, once the save's handle
  // has completed (list(), latest() and load*() wait for it). A committed step is kept when it is
  // one of the newest keep_last (0: keep all) or a multiple of keep_every (0: none). Directories
  // without a manifest (failed or interrupted saves) are always removed.
  int keep_last = 0;
  int64_t keep_every = 0;
  // When save() is called while the previous save is still in flight: false waits for it,
  // true skips the new save with a warning (the handle reports skipped(); on every rank).
  bool skip_if_busy = false;
  // Deadline for the cross-rank steps of a save (reports, commit) and for a save() that
  // waits for the previous one. Passing it fails the save with Timeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  size_t write_bytes = size_t{8} << 20;  // bytes per write of the I/O threads (a multiple of
                                         // 4 KiB)
  // Writes in flight at save, each on its own I/O thread, while the writer thread hashes the
  // next bytes.
  int io_threads = 2;
  // At load: bytes per read (a multiple of 4 KiB) and reads in flight, each on its own thread,
  // while the loading thread checks and copies the reads in order. Reads of 1 MiB, 4 in flight,
  // loaded 1 GiB about 1.8x faster than 8 MiB, 2 in flight on the development VM
  // (docs/checkpoint.md).
  size_t read_bytes = size_t{1} << 20;
  int reads_in_flight = 4;
  // Write and read data files with O_DIRECT, straight from the staging buffer: no copy into the
  // page cache, which on these VMs costs more than the disk itself. Falls back to buffered I/O
  // (with early writeback) where the file system refuses O_DIRECT (tmpfs). Reads of less than
  // 256 KiB always go through the page cache.
  bool direct_io = true;
  size_t hash_chunk_bytes = size_t{4} << 20;  // bytes per hashed chunk: the unit a partial
                                              // read must fetch to verify what it reads
  std::string store_prefix = "ckpt";          // Store keys: <prefix>/<step>/...
  std::shared_ptr<spdlog::logger> logger;     // warnings (skips, fallbacks); spdlog's default
                                              // logger when null
};

struct SaveOptions {
  // false: save() copies the state into staging memory before it returns (the stall).
  // true: save() only records the tensors and returns at once; the copy happens at the next
  // before_optimizer_step() (or wait(), or the next save()). Between save() and that call
  // the caller must not modify any saved tensor in place: in a training loop the parameters
  // and optimizer state change only in the optimizer step, so calling save() after step N's
  // optimizer step and before_optimizer_step() just before step N+1's lets the copy overlap
  // step N+1's data loading, forward and backward. The State's tensors are held (shared,
  // not copied) until the copy.
  bool defer_copy = false;
  // With defer_copy: the Checkpointer's copy thread starts copying CPU tensors at save(), on
  // one core while the caller computes, and before_optimizer_step() waits only for what is
  // left. false: the whole copy happens in before_optimizer_step(), over torch's intra-op
  // threads (faster alone, but the training thread waits for all of it). CUDA tensors copy on
  // a side stream from save() either way; strided CPU tensors at before_optimizer_step().
  bool background_copy = true;
};

struct LoadOptions {
  bool verify = true;  // hash every chunk read; a mismatch is CorruptData
  // PyTorch's load_state_dict(strict) semantics. true: every tensor and blob of the checkpoint
  // must be asked for (or named in leave_out); one the state does not have is an error naming
  // it, so that a changed model does not silently drop saved weights. false: they are
  // allowed (e.g. load only the model) and a warning lists what was left out. A tensor or blob
  // the caller asks for that the checkpoint lacks is an error either way.
  bool strict = true;
  // Names of tensors and blobs of the checkpoint the caller knowingly does not load (the
  // per-rank RNG at another world size, a saved config): never an error, never logged.
  std::vector<std::string> leave_out;
};

// A committed step, as list() reports it.
struct CheckpointInfo {
  int64_t step = 0;
  std::filesystem::path path;  // the step directory
  uint64_t bytes = 0;          // data files' total size
  int world_size = 0;          // ranks that saved it
};

// The outcome of one save(). Copyable (copies refer to the same save). wait() may be called
// from any thread and more than once; done() never blocks.
class LOOM_API SaveHandle {
 public:
  struct LOOM_HIDDEN Job;  // private
  SaveHandle() = default;
  explicit SaveHandle(std::shared_ptr<Job> job) : job_(std::move(job)) {}

  // Blocks until the step is committed (or skipped). When the copy was deferred and has not
  // happened yet, performs it first, on the calling thread. Raises what failed the save, on
  // every rank: this rank's own error (IoError with its cause: ENOSPC, a failed fsync...), or
  // IoError naming the rank whose write failed, or Timeout. Passing `timeout` is Timeout
  // naming the step; the save continues in the background.
  void wait(std::chrono::milliseconds timeout = std::chrono::minutes(10));
  bool done() const;
  bool skipped() const;  // the save was skipped (skip_if_busy) on this or another rank
  int64_t step() const;
  bool valid() const { return job_ != nullptr; }

 private:
  std::shared_ptr<Job> job_;
};

// Thread safety: save(), before_optimizer_step(), load*() and list() are called from one
// thread (the training loop); the writer and copy threads are internal. The Store must outlive the
// Checkpointer. The destructor completes a save in flight (copying a deferred one first) and
// logs, never throws, its error.
class LOOM_API Checkpointer {
 public:
  static constexpr int64_t kLatest = -1;

  Checkpointer(comm::Store& store, CheckpointerOptions options);
  // Tests: the same with an injected storage seam.
  Checkpointer(comm::Store& store, CheckpointerOptions options, std::shared_ptr<Storage> storage);
  // Waits for the save in flight (up to options().timeout) and logs its failure. While the
  // owner unwinds from an exception, that save's commit does not wait for other ranks (a dead
  // peer never reports): it fails at once and the step is not committed.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Starts saving `state` as `step`. Validates the state (InvalidArgument: duplicate names,
  // shapes that disagree with their sharding, an unsupported dtype, a blob that is not JSON,
  // a step already committed). Staging memory is allocated on the first save and reused; it
  // grows only when a later state is larger. At most one save is in flight (options).
  SaveHandle save(int64_t step, const State& state, const SaveOptions& options = {});
  // save() then wait(2 * options.timeout).
  void save_sync(int64_t step, const State& state);
  // Performs a deferred copy now, if one is pending; otherwise returns at once.
  void before_optimizer_step();

  // Fills `state` in place from `step` (or the newest committed step): every tensor must be
  // allocated with the piece this rank wants (its sharding at the current world size, any
  // kind) and every blob named in state.blobs is replaced. Returns the step loaded.
  // Differences (a missing tensor or blob, another dtype or global shape, with strict an
  // unexpected tensor or blob) are InvalidArgument listing them all; bad bytes are CorruptData
  // naming tensor and file; no committed step is IoError.
  int64_t load(int64_t step, State& state, const LoadOptions& options = {});
  int64_t load(State& state, const LoadOptions& options = {}) {
    return load(kLatest, state, options);
  }
  // Like load(kLatest), but when the newest step is corrupt or unreadable, logs why and tries
  // the previous committed one, and so on. Differences of names, shapes or dtypes are not
  // fallen back from. Raises the newest step's error when none loads.
  int64_t load_latest_valid(State& state, const LoadOptions& options = {});

  // Committed steps, ascending.
  std::vector<CheckpointInfo> list() const;
  std::optional<int64_t> latest() const;
  // Reads every byte of `step` and checks every hash; CorruptData names tensor and file.
  void verify(int64_t step) const;

  const CheckpointerOptions& options() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::ckpt
