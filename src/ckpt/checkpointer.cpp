// The asynchronous checkpointer (see loom/ckpt/checkpointer.h and docs/checkpoint.md).
//
// A save is validate, stage, enqueue. The training thread checks the state and plans this
// rank's file (layout.h), makes sure the previous save is done with the staging buffer, builds
// this rank's report, queues a Job for the writer thread and copies the tensors into the one
// reusable staging buffer, laid out exactly like the file (or, with defer_copy, hands the copy
// to the copy thread, which copies CPU tensors while the caller computes, and
// before_optimizer_step() waits for it; without background_copy, the training thread copies
// there itself). CUDA tensors go into pinned staging memory by device-to-host
// copies on a side stream (device_copy.h), enqueued at save() and overlapping the next
// forward/backward; the deferred copy() then only makes the compute stream wait for them.
//
// The writer thread works as a pipeline over the staging buffer in file order: it hashes each
// chunk as soon as the copy has put it in place, and hands every write_bytes block it hashed to
// the I/O threads (io_queue.h), which write it with O_DIRECT while the next blocks are copied
// and hashed. Then it fsyncs, renames, fsyncs the directory and runs the commit protocol
// (commit.h): ranks 1..W-1 report, rank 0 collects the reports, writes the manifest and decides.
#include "loom/ckpt/checkpointer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "ckpt/commit.h"
#include "ckpt/device_copy.h"
#include "ckpt/io_queue.h"
#include "ckpt/layout.h"
#include "ckpt/manifest.h"
#include "ckpt/reader.h"
#include "ckpt/storage.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "loom/metrics/trace.h"
#include "util/hash.h"
#include "util/thread_name.h"

namespace loom::ckpt {
namespace {

using Clock = std::chrono::steady_clock;

// The copy publishes its progress to the writer after each block of this many bytes.
constexpr uint64_t kCopyBlock = uint64_t{32} << 20;

// The message of an exception_ptr.
std::string what_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

// Appends the reads that fill `dest` (a tensor's bytes of `element_size`-byte elements) with the
// runs of `region`, one after the other, from `record`.
void add_reads(std::vector<StepReader::Request>& reads, const TensorRecord* record,
               const Region& region, char* dest, int64_t element_size) {
  for (const Run& run : region.runs) {
    reads.push_back({record, run.begin, run.end, dest});
    dest += (run.end - run.begin) * element_size;
  }
}

}  // namespace

// One save, shared by the training thread, the writer thread and the handles.
struct SaveHandle::Job {
  // Constant once the job is queued.
  int64_t step = 0;
  FilePlan plan;
  Manifest report;  // this rank's report, hashes filled in by the writer
  char* staging = nullptr;
  // The device-to-host copies of the CUDA pieces, enqueued by save(); null without any.
  std::shared_ptr<internal::CopyFence> fence;

  // State below is protected by mutex; changed is notified when staged, copied or finished
  // change.
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<at::Tensor> pending;  // the tensors to copy (one per planned piece) until copied;
                                    // read by the copying thread alone once copy_started
  bool copy_started = false;
  uint64_t staged = 0;  // staging bytes [0, staged) hold their final contents (CPU pieces)
  bool copied = false;
  std::exception_ptr copy_error;
  bool finished = false;
  bool skipped = false;
  std::exception_ptr error;

  // Copies the pending tensors into staging, in file order, publishing `staged` after each
  // block so that the writer hashes and writes behind the copy. Once: a later call waits for
  // the first to finish and returns. `parallel`: over torch's intra-op threads (the training
  // thread, stalled anyway); otherwise on the calling thread alone (the copy thread, beside
  // the training thread's compute).
  void copy(bool parallel = true) {
    {
      std::unique_lock<std::mutex> lock(mutex);
      if (copy_started) {
        changed.wait(lock, [&] { return copied; });
        return;
      }
      copy_started = true;
    }
    std::exception_ptr failure;
    metrics::TraceSpan span("checkpoint", "checkpoint copy");
    if (span.recording()) span.args(detail::concat("{\"step\":", step, "}"));
    try {
      copy_pieces(parallel);
      // The caller may change the CUDA tensors once copy() returned: later work on the compute
      // stream waits for their copies (on the GPU; the host goes on).
      if (fence) fence->order_compute_stream();
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex);
    pending.clear();
    copied = true;
    copy_error = std::move(failure);
    changed.notify_all();
  }

  void copy_pieces(bool parallel) {
    at::NoGradGuard no_grad;
    uint64_t end_of_previous = 0;
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      const PlannedPiece& p = plan.pieces[i];
      // Alignment padding is zeroed, so files hold nothing but the state.
      std::memset(staging + end_of_previous, 0, p.offset - end_of_previous);
      end_of_previous = p.offset + p.bytes;
      const at::Tensor& src = pending[i];
      if (src.is_cuda()) {
        continue;  // already enqueued on the side stream by save()
      } else if (src.device().is_cpu() && src.is_contiguous()) {
        // memcpy a block at a time, over torch's intra-op threads when asked.
        const char* from = static_cast<const char*>(src.data_ptr());
        char* to = staging + p.offset;
        for (uint64_t b = 0; b < p.bytes; b += kCopyBlock) {
          const int64_t n = static_cast<int64_t>(std::min(kCopyBlock, p.bytes - b));
          if (parallel) {
            at::parallel_for(0, n, int64_t{8} << 20, [&](int64_t begin, int64_t end) {
              std::memcpy(to + b + begin, from + b + begin, static_cast<size_t>(end - begin));
            });
          } else {
            std::memcpy(to + b, from + b, static_cast<size_t>(n));
          }
          publish(p.offset + b + n);
        }
      } else {  // strided or on a device: torch copies (and moves to the CPU)
        at::from_blob(staging + p.offset, src.sizes(), src.options().device(at::kCPU)).copy_(src);
      }
      publish(p.offset + p.bytes);
    }
  }

  void publish(uint64_t end) {
    std::lock_guard<std::mutex> lock(mutex);
    staged = end;
    changed.notify_all();
  }

  // The writer thread: blocks until staging bytes [0, end) are in place (or the copy ended);
  // raises the copy's failure. With CUDA pieces, until the whole copy and the device copies.
  void wait_staged(uint64_t end) {
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] { return copied || (!fence && staged >= end); });
      if (copy_error) std::rethrow_exception(copy_error);
      if (!copied || !fence) return;
    }
    fence->wait();  // once the device copies landed, later calls return at once
  }

  void wait_copied() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return copied; });
  }

  void finish(bool was_skipped, std::exception_ptr failure) {
    std::lock_guard<std::mutex> lock(mutex);
    finished = true;
    skipped = was_skipped;
    error = std::move(failure);
    changed.notify_all();
  }

  // Waits until finished; false when the deadline passed first.
  bool wait_finished(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_until(lock, deadline, [&] { return finished; });
  }
};

void SaveHandle::wait(std::chrono::milliseconds timeout) {
  LOOM_CHECK(job_ != nullptr, InvalidArgument, "wait() on an empty SaveHandle");
  const auto deadline = Clock::now() + timeout;
  job_->copy();
  LOOM_CHECK(job_->wait_finished(deadline), Timeout, "checkpoint save of step ", job_->step,
             " did not finish within ", timeout.count(),
             " ms (it continues in the background; a slow disk or a rank that never saved "
             "this step keeps it waiting)");
  std::lock_guard<std::mutex> lock(job_->mutex);
  if (job_->error) std::rethrow_exception(job_->error);
}

bool SaveHandle::done() const {
  if (!job_) return true;
  std::lock_guard<std::mutex> lock(job_->mutex);
  return job_->finished;
}

bool SaveHandle::skipped() const {
  if (!job_) return false;
  std::lock_guard<std::mutex> lock(job_->mutex);
  return job_->skipped;
}

int64_t SaveHandle::step() const { return job_ ? job_->step : -1; }

struct Checkpointer::Impl {
  using Job = SaveHandle::Job;

  Impl(comm::Store& s, CheckpointerOptions o, std::shared_ptr<Storage> st)
      : store(s),
        options(std::move(o)),
        storage(std::move(st)),
        log(options.logger ? options.logger : spdlog::default_logger()),
        io(options.io_threads) {}

  // Constant after construction.
  comm::Store& store;
  const CheckpointerOptions options;
  const std::shared_ptr<Storage> storage;
  const std::shared_ptr<spdlog::logger> log;

  // Used by the writer thread only: the data files' writes.
  IoQueue io;

  // Touched by the training thread only (and the destructor).
  std::shared_ptr<Job> current;      // the newest save, maybe in flight
  std::optional<int64_t> last_step;  // the step of the newest save() that got past validation
  internal::HostBuffer staging;      // reused by every save; grown when a file needs more
  bool staging_pin_asked = false;    // staging was allocated for CUDA tensors (pinned if it could)
  std::unique_ptr<internal::DeviceStager> stager;  // made at the first save of a CUDA tensor
  internal::HostBuffer load_buffer;   // pinned, reused: reads of CUDA tensors land here first
  internal::HostBuffer read_buffers;  // the read pipeline's buffers, reused by every load

  // State below is protected by mutex; wake is notified when queued, to_copy, stop or
  // retiring change.
  std::mutex mutex;
  std::condition_variable wake;
  std::shared_ptr<Job> queued;
  std::shared_ptr<Job> to_copy;  // a background copy for the copy thread
  bool stop = false;
  bool retiring = false;  // rank 0's writer is applying retention after a commit
  // Set by the destructor while its owner unwinds: the commit stops waiting for other ranks.
  std::atomic<bool> abandon{false};

  std::thread writer;  // started last in the constructor, with the copier
  std::thread copier;

  std::filesystem::path step_dir(int64_t step) const { return options.dir / step_dir_name(step); }
  StepCommit commit_of(int64_t step) const {
    StepCommit commit(store, options.store_prefix, step, options.rank, options.world_size);
    commit.abandon_when(abandon);
    return commit;
  }
  // Used by load(), verify() and friends on the training thread.
  ReadOptions read_options() {
    return {.io_threads = options.reads_in_flight,
            .read_bytes = options.read_bytes,
            .direct_io = options.direct_io,
            .buffers = &read_buffers};
  }

  // save(), on the training thread.
  FilePlan validate(int64_t step, const State& state);
  std::shared_ptr<Job> make_room(int64_t step);  // a skipped job, or null when the step goes on
  std::shared_ptr<Job> stage(int64_t step, const State& state, FilePlan plan);
  void enqueue(const std::shared_ptr<Job>& job);
  // Whether the copy thread can copy the job: contiguous CPU tensors only (CUDA pieces copy
  // on a side stream that the training thread must order; strided ones need torch's copy).
  static bool copies_in_background(const Job& job) {
    return !job.fence &&
           std::all_of(job.pending.begin(), job.pending.end(), [](const at::Tensor& t) {
             return t.device().is_cpu() && t.is_contiguous();
           });
  }

  // The copy thread: SaveOptions::background_copy.
  void copier_loop();
  // The writer thread.
  void writer_loop();
  void run_job(Job& job);
  void write_file(Job& job);
  // Rank 0: collects the reports, writes the manifest, decides. Returns true when skipped.
  bool commit(StepCommit& commit, Job& job);
  void write_manifest(int64_t step, const Manifest& manifest);
  void apply_retention(int64_t step);
  void wait_retention();

  int64_t load_step(int64_t step, State& state, const LoadOptions& options);
};

void Checkpointer::Impl::copier_loop() {
  util::name_this_thread("ckpt copy");
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stop || to_copy; });
      if (!to_copy) return;
      job = std::move(to_copy);
    }
    job->copy(/*parallel=*/false);  // at once when the training thread has copied it already
  }
}

void Checkpointer::Impl::writer_loop() {
  util::name_this_thread("ckpt writer");
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stop || queued; });
      if (!queued) return;
      job = std::move(queued);
    }
    run_job(*job);
  }
}

void Checkpointer::Impl::run_job(Job& job) {
  const int rank = options.rank;
  StepCommit protocol = commit_of(job.step);
  bool skipped = false;
  std::exception_ptr failure;
  try {
    metrics::TraceSpan span("checkpoint", "checkpoint write");
    if (span.recording()) span.args(detail::concat("{\"step\":", job.step, "}"));
    write_file(job);
  } catch (...) {
    failure = std::current_exception();
    // Tell rank 0 (or, on rank 0, everyone) so that nothing is committed and nobody hangs.
    const std::string cause = detail::concat("rank ", rank, " could not write its file ",
                                             (step_dir(job.step) / data_file_name(rank)).string(),
                                             ": ", what_of(failure));
    try {
      if (rank == 0) {
        protocol.decide(Decision::kFailed, cause);
      } else {
        protocol.report(RankStatus::kFailed, cause);
      }
    } catch (const std::exception& e) {
      log->error("checkpoint step {}: could not report the failure to the store: {}", job.step,
                 e.what());
    }
  }
  if (!failure) {
    metrics::TraceSpan span("checkpoint", "checkpoint commit");
    if (span.recording()) span.args(detail::concat("{\"step\":", job.step, "}"));
    try {
      if (rank == 0) {
        skipped = commit(protocol, job);
      } else {
        protocol.report(RankStatus::kWritten, to_json(job.report));
        const Verdict verdict = protocol.await_decision(Clock::now() + options.timeout);
        if (verdict.decision == Decision::kSkipped) {
          skipped = true;
        } else if (verdict.decision == Decision::kFailed) {
          throw IoError(
              detail::concat("checkpoint step ", job.step, " was not committed: ", verdict.detail));
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (skipped) log->warn("checkpoint step {} was skipped: a rank was still saving", job.step);
  try {
    protocol.finish();
  } catch (const std::exception& e) {
    log->warn("checkpoint step {}: could not clean its store keys: {}", job.step, e.what());
  }
  // Rank 0 applies retention after the handle completes: deleting old steps is not part of
  // the save. list(), latest() and load*() wait for it (retiring).
  const bool retain = options.rank == 0 && !failure && !skipped;
  if (retain) {
    std::lock_guard<std::mutex> lock(mutex);
    retiring = true;
  }
  job.finish(skipped, failure);
  if (!retain) return;
  try {
    apply_retention(job.step);
  } catch (const std::exception& e) {
    log->warn("checkpoint retention after step {} failed (the step is committed): {}", job.step,
              e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    retiring = false;
  }
  wake.notify_all();
}

void Checkpointer::Impl::wait_retention() {
  std::unique_lock<std::mutex> lock(mutex);
  wake.wait(lock, [&] { return !retiring; });
}

void Checkpointer::Impl::write_file(Job& job) {
  const auto dir = step_dir(job.step);
  storage->create_dirs(dir);
  const auto start = Clock::now();
  const auto name = data_file_name(options.rank);
  const auto temp = dir / ("." + name + ".tmp");
  auto file = storage->create(temp, options.direct_io);
  // Direct writes need aligned lengths: the last one is padded with zeros (inside the staging
  // capacity, a multiple of the alignment, which the copy does not touch) and the file
  // truncated back afterwards.
  const uint64_t padded = file->direct() ? (job.plan.file_bytes + kDirectAlignment - 1) /
                                               kDirectAlignment * kDirectAlignment
                                         : job.plan.file_bytes;
  if (padded > job.plan.file_bytes)
    std::memset(job.staging + job.plan.file_bytes, 0, padded - job.plan.file_bytes);
  // Writes in flight reference the file and staging: they finish before either goes, also when
  // this function raises.
  struct Drain {
    IoQueue& io;
    ~Drain() { io.drain_quietly(); }
  } drain{io};
  // One pass over the staging buffer in file order: wait for the copy to have put a chunk in
  // place, hash it (per chunk, and into its piece's hash), and once write_bytes are hashed hand
  // them to an I/O thread, so that the disk works while the next chunks are copied and hashed.
  uint64_t written = 0;
  auto write_up_to = [&](uint64_t end, bool last) {
    while (end - written >= options.write_bytes || (last && written < end)) {
      const uint64_t n = std::min<uint64_t>(options.write_bytes, end - written);
      WritableFile* f = file.get();
      const char* data = job.staging + written;
      io.submit([f, data, at = written, n] {
        write_all_at(*f, at, data, n);
        f->start_writeback(at, n);
      });
      written += n;
    }
  };
  // The report's pieces are in file order.
  for (auto& t : job.report.tensors) {
    for (Piece& piece : t.pieces) {
      const char* bytes = job.staging + piece.offset;
      piece.chunk_hashes.clear();
      for (uint64_t cs = 0; cs < piece.bytes; cs += piece.chunk_bytes) {
        const uint64_t n = std::min<uint64_t>(piece.chunk_bytes, piece.bytes - cs);
        job.wait_staged(piece.offset + cs + n);
        piece.chunk_hashes.push_back(util::xxh64(bytes + cs, n));
        write_up_to(piece.offset + cs + n, false);
      }
      piece.hash = piece_hash(piece.chunk_hashes);
    }
  }
  job.wait_staged(job.plan.file_bytes);
  write_up_to(padded, true);
  io.drain();  // raises the first failed write
  if (padded != job.plan.file_bytes) file->truncate(job.plan.file_bytes);
  const auto written_at = Clock::now();
  file->sync();
  file.reset();
  storage->rename(temp, dir / name);
  storage->sync_dir(dir);
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  log->debug("checkpoint step {}: {} bytes hashed and written in {:.3f} s, synced in {:.3f} s",
             job.step, job.plan.file_bytes, seconds(start, written_at),
             seconds(written_at, Clock::now()));
}

bool Checkpointer::Impl::commit(StepCommit& protocol, Job& job) {
  std::vector<RankReport> reports = protocol.await_reports(Clock::now() + options.timeout);
  const Verdict verdict = tally(reports);
  if (verdict.decision == Decision::kSkipped) {
    protocol.decide(Decision::kSkipped, verdict.detail);
    return true;
  }
  if (verdict.decision == Decision::kFailed) {
    protocol.decide(Decision::kFailed, verdict.detail);
    throw IoError(
        detail::concat("checkpoint step ", job.step, " was not committed: ", verdict.detail));
  }
  try {
    std::vector<Manifest> manifests{job.report};
    for (const RankReport& r : reports)
      manifests.push_back(parse_manifest(r.detail, detail::concat("rank ", r.rank, "'s report")));
    write_manifest(job.step, merge_reports(job.step, manifests));
  } catch (const std::exception& e) {
    protocol.decide(Decision::kFailed, detail::concat("rank 0 could not commit: ", e.what()));
    throw;
  }
  protocol.decide(Decision::kCommitted);
  return false;
}

// The commit point: the manifest in place and durable. A failure at any part of it (the
// write, its fsync, the rename, the directory's fsync) removes the manifest again, so the
// previous step stays the newest.
void Checkpointer::Impl::write_manifest(int64_t step, const Manifest& manifest) {
  const auto dir = step_dir(step);
  const auto temp = dir / ("." + std::string(kManifestName) + ".tmp");
  const std::string text = to_json(manifest);
  try {
    {
      auto file = storage->create(temp);
      write_all_at(*file, 0, text.data(), text.size());
      file->sync();
    }
    storage->rename(temp, dir / kManifestName);
    storage->sync_dir(dir);
  } catch (...) {
    try {
      storage->remove(dir / kManifestName);
      storage->remove(temp);
      storage->sync_dir(dir);
    } catch (const std::exception& e) {
      // Still not a broken checkpoint: every data file was durable before the manifest was
      // written, so a manifest that reappears after a crash describes a complete step.
      log->error("checkpoint step {}: could not remove the manifest after a failed commit: {}",
                 step, e.what());
    }
    throw;
  }
}

void Checkpointer::Impl::apply_retention(int64_t step) {
  const std::vector<int64_t> steps = committed_steps(*storage, options.dir);
  std::set<int64_t> keep{step};
  const size_t n = steps.size();
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = steps[i];
    if (options.keep_last <= 0 || i + static_cast<size_t>(options.keep_last) >= n) keep.insert(s);
    if (options.keep_every > 0 && s % options.keep_every == 0) keep.insert(s);
  }
  for (int64_t s : steps) {
    if (keep.count(s)) continue;
    // The manifest goes first and durably: a crash mid-removal leaves a directory that is not
    // a checkpoint (removed next time), never a checkpoint with missing files.
    const auto dir = step_dir(s);
    storage->remove(dir / kManifestName);
    storage->sync_dir(dir);
    storage->remove_all(dir);
  }
  // Partial saves of earlier steps. Later steps are left alone: once commit is set the other
  // ranks may already be writing the next step (steps only grow within a run).
  for (const auto& dir : uncommitted_dirs(*storage, options.dir))
    if (parse_step_dir_name(dir.filename().string()).value_or(step) < step)
      storage->remove_all(dir);
  storage->sync_dir(options.dir);
}

Checkpointer::Checkpointer(comm::Store& store, CheckpointerOptions options)
    : Checkpointer(store, std::move(options), posix_storage()) {}

Checkpointer::Checkpointer(comm::Store& store, CheckpointerOptions options,
                           std::shared_ptr<Storage> storage) {
  LOOM_CHECK(!options.dir.empty(), InvalidArgument, "CheckpointerOptions.dir is empty");
  LOOM_CHECK(options.world_size > 0 && options.rank >= 0 && options.rank < options.world_size,
             InvalidArgument, "CheckpointerOptions: rank ", options.rank,
             " is not in [0, world_size = ", options.world_size, ")");
  LOOM_CHECK(options.write_bytes > 0 && options.write_bytes % kDirectAlignment == 0 &&
                 options.read_bytes > 0 && options.read_bytes % kDirectAlignment == 0 &&
                 options.hash_chunk_bytes >= 16 && options.io_threads > 0 &&
                 options.reads_in_flight > 0,
             InvalidArgument,
             "CheckpointerOptions: write_bytes and read_bytes must be positive multiples of "
             "4096, hash_chunk_bytes >= 16, io_threads and reads_in_flight > 0");
  LOOM_CHECK(storage != nullptr, InvalidArgument, "Checkpointer: storage is null");
  storage->create_dirs(options.dir);
  impl_ = std::make_unique<Impl>(store, std::move(options), std::move(storage));
  impl_->writer = std::thread([impl = impl_.get()] { impl->writer_loop(); });
  impl_->copier = std::thread([impl = impl_.get()] { impl->copier_loop(); });
}

Checkpointer::~Checkpointer() {
  if (impl_->current) {
    // Unwinding from a failure (a peer died, a collective failed) the other ranks' reports may
    // never come: this rank's writes finish, but the commit gives up at once instead of holding
    // the process for CheckpointerOptions::timeout, and the step is not committed.
    if (std::uncaught_exceptions() > 0) impl_->abandon = true;
    try {
      SaveHandle(impl_->current).wait(impl_->options.timeout);
    } catch (const std::exception& e) {
      impl_->log->error("checkpoint step {} failed: {}", impl_->current->step, e.what());
    }
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  impl_->writer.join();
  impl_->copier.join();
}

const CheckpointerOptions& Checkpointer::options() const { return impl_->options; }

FilePlan Checkpointer::Impl::validate(int64_t step, const State& state) {
  LOOM_CHECK(step >= 0, InvalidArgument, "checkpoint step must be >= 0, got ", step);
  FilePlan plan = plan_file(state, options.rank);  // validates before anything waits
  if (options.rank == 0) {
    for (const auto& [name, text] : state.blobs) {
      LOOM_CHECK(nlohmann::json::accept(text), InvalidArgument, "checkpoint blob \"", name,
                 "\" is not valid JSON");
    }
  }
  // Steps only grow within a run: retention and the commit protocol rely on it.
  LOOM_CHECK(!last_step || step > *last_step, InvalidArgument, "checkpoint step ", step,
             " was asked for after step ", last_step.value_or(0),
             "; steps must increase from save to save");
  // The save in flight is of an earlier step: it cannot commit this one meanwhile.
  LOOM_CHECK(!storage->exists(step_dir(step) / kManifestName), InvalidArgument, "checkpoint step ",
             step, " is already committed in ", options.dir.string(),
             "; save under a new step or remove that directory first");
  return plan;
}

std::shared_ptr<SaveHandle::Job> Checkpointer::Impl::make_room(int64_t step) {
  if (!current) return nullptr;
  // The previous save must be done with the staging buffer.
  current->copy();
  if (!SaveHandle(current).done() && options.skip_if_busy) {
    log->warn("checkpoint step {} skipped: the save of step {} is still in flight", step,
              current->step);
    const std::string why = detail::concat("the save of step ", current->step,
                                           " was still in flight on rank ", options.rank);
    StepCommit protocol = commit_of(step);
    if (options.rank == 0) {
      protocol.decide(Decision::kSkipped, why);
    } else {
      protocol.report(RankStatus::kSkipped, why);
    }
    protocol.finish();
    last_step = step;
    auto job = std::make_shared<Job>();
    job->step = step;
    job->copy_started = job->copied = true;
    job->finish(true, nullptr);
    return job;
  }
  const auto deadline = Clock::now() + options.timeout;
  LOOM_CHECK(current->wait_finished(deadline), Timeout, "checkpoint step ", step,
             ": the save of step ", current->step, " did not finish within ",
             options.timeout.count(), " ms");
  current.reset();
  return nullptr;
}

std::shared_ptr<SaveHandle::Job> Checkpointer::Impl::stage(int64_t step, const State& state,
                                                           FilePlan plan) {
  auto job = std::make_shared<Job>();
  job->step = step;
  last_step = step;
  const bool on_device = std::any_of(plan.pieces.begin(), plan.pieces.end(), [&](const auto& p) {
    return state.tensors[p.entry].tensor.is_cuda();
  });
  if (plan.file_bytes > staging.size() || (on_device && !staging_pin_asked)) {
    // Allocated once and reused; pinned once a CUDA tensor is saved (DMA straight into it).
    const bool pin = on_device || staging_pin_asked;
    staging = internal::HostBuffer();
    staging = internal::HostBuffer(std::max<size_t>(plan.file_bytes, 1), pin);
    staging_pin_asked = pin;
    if (!staging.pinned()) {
      // Fault every page in now, over torch's threads: the copy thread, faulting 1 GiB of new
      // pages in alone beside the training thread's compute, took seconds (bench_ckpt's
      // step_stall_cold).
      char* pages = staging.data();
      at::parallel_for(0, static_cast<int64_t>(staging.size()), int64_t{64} << 20,
                       [&](int64_t begin, int64_t end) {
                         std::memset(pages + begin, 0, static_cast<size_t>(end - begin));
                       });
    }
  }
  job->staging = staging.data();

  // This rank's report: its file, one record per tensor it describes, pieces in plan order.
  Manifest& report = job->report;
  report.step = step;
  report.world_size = options.world_size;
  report.files.push_back({data_file_name(options.rank), options.rank, plan.file_bytes});
  if (options.rank == 0) report.blobs = state.blobs;
  size_t next_piece = 0;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const TensorEntry& e = state.tensors[i];
    if (e.sharding.kind == Sharding::Kind::kReplicated && options.rank != 0) continue;
    Region region = region_of(e);
    TensorRecord record{e.name,
                        dtype_name(e.tensor.scalar_type()),
                        region.global_shape,
                        kind_name(e.sharding.kind),
                        {}};
    if (next_piece < plan.pieces.size() && plan.pieces[next_piece].entry == i) {
      // One manifest piece per run, one after the other in the file.
      const PlannedPiece& p = plan.pieces[next_piece++];
      const uint64_t es = e.tensor.element_size();
      const uint64_t chunk = std::max<uint64_t>(es, options.hash_chunk_bytes / es * es);
      uint64_t offset = p.offset;
      for (const Run& run : p.region.runs) {
        const uint64_t bytes = static_cast<uint64_t>(run.end - run.begin) * es;
        record.pieces.push_back(
            {data_file_name(options.rank), run.begin, run.end, offset, bytes, 0, chunk, {}});
        offset += bytes;
      }
      job->pending.push_back(e.tensor);
    }
    report.tensors.push_back(std::move(record));
  }
  // CUDA pieces start copying now, on the side stream, whether or not the copy is deferred.
  for (size_t i = 0; i < job->pending.size(); ++i) {
    if (!job->pending[i].is_cuda()) continue;
    if (!stager) stager = internal::new_device_stager();
    stager->copy_to_host(job->pending[i], job->staging + plan.pieces[i].offset);
  }
  if (stager) job->fence = stager->fence();
  job->plan = std::move(plan);
  return job;
}

void Checkpointer::Impl::enqueue(const std::shared_ptr<Job>& job) {
  current = job;
  {
    std::lock_guard<std::mutex> lock(mutex);
    queued = job;
  }
  wake.notify_all();
}

SaveHandle Checkpointer::save(int64_t step, const State& state, const SaveOptions& save_options) {
  Impl& m = *impl_;
  FilePlan plan = m.validate(step, state);
  if (auto skipped = m.make_room(step)) return SaveHandle(skipped);
  std::shared_ptr<SaveHandle::Job> job = m.stage(step, state, std::move(plan));
  m.enqueue(job);
  // The writer hashes and writes behind the copy, block by block.
  if (!save_options.defer_copy) {
    job->copy();
  } else if (save_options.background_copy && m.copies_in_background(*job)) {
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      m.to_copy = job;
    }
    m.wake.notify_all();
  }
  return SaveHandle(job);
}

void Checkpointer::save_sync(int64_t step, const State& state) {
  // Twice the cross-rank deadline: the save's own Timeout (naming what it waited for) comes
  // first when a rank never reports.
  save(step, state).wait(2 * impl_->options.timeout);
}

void Checkpointer::before_optimizer_step() {
  if (impl_->current) impl_->current->copy();
}

std::vector<CheckpointInfo> Checkpointer::list() const {
  impl_->wait_retention();
  std::vector<CheckpointInfo> out;
  for (int64_t step : committed_steps(*impl_->storage, impl_->options.dir)) {
    const auto dir = impl_->step_dir(step);
    try {
      Manifest m = read_manifest(*impl_->storage, dir);
      out.push_back({step, dir, m.data_bytes(), m.world_size});
    } catch (const Error& e) {
      impl_->log->warn("checkpoint {}: unreadable manifest: {}", dir.string(), e.what());
    }
  }
  return out;
}

std::optional<int64_t> Checkpointer::latest() const {
  impl_->wait_retention();
  auto steps = committed_steps(*impl_->storage, impl_->options.dir);
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

void Checkpointer::verify(int64_t step) const {
  const auto dir = impl_->step_dir(step);
  StepReader reader(impl_->storage, dir, read_manifest(*impl_->storage, dir),
                    impl_->read_options());
  reader.verify_all();
}

int64_t Checkpointer::Impl::load_step(int64_t step, State& state, const LoadOptions& load_options) {
  wait_retention();
  const auto dir = step_dir(step);
  LOOM_CHECK(storage->exists(dir / kManifestName), IoError, "checkpoint step ", step,
             " is not committed in ", options.dir.string(), " (no ", (dir / kManifestName).string(),
             ")");
  Manifest manifest = read_manifest(*storage, dir);
  std::vector<std::string> differences;
  std::vector<std::pair<const TensorRecord*, Region>> plan;
  std::set<std::string> asked;
  for (const TensorEntry& e : state.tensors) {
    asked.insert(e.name);
    Region region = region_of(e);
    const TensorRecord* record = manifest.find(e.name);
    if (record == nullptr) {
      differences.push_back(detail::concat("tensor \"", e.name, "\" is not in the checkpoint"));
      continue;
    }
    const std::string dtype = dtype_name(e.tensor.scalar_type());
    if (record->dtype != dtype)
      differences.push_back(detail::concat("tensor \"", e.name, "\": dtype ", dtype, " asked for, ",
                                           record->dtype, " saved"));
    if (record->shape != region.global_shape) {
      differences.push_back(detail::concat("tensor \"", e.name, "\": global shape ",
                                           c10::IntArrayRef(region.global_shape), " asked for, ",
                                           c10::IntArrayRef(record->shape), " saved"));
    }
    plan.emplace_back(record, std::move(region));
  }
  for (const auto& [name, text] : state.blobs)
    if (!manifest.blobs.count(name))
      differences.push_back(detail::concat("blob \"", name, "\" is not in the checkpoint"));
  // What the checkpoint holds that the state does not ask for.
  const std::set<std::string> leave_out(load_options.leave_out.begin(),
                                        load_options.leave_out.end());
  std::vector<std::string> unexpected;
  for (const TensorRecord& t : manifest.tensors)
    if (!asked.count(t.name) && !leave_out.count(t.name))
      unexpected.push_back(detail::concat("tensor \"", t.name, "\""));
  for (const auto& [name, text] : manifest.blobs)
    if (!state.blobs.count(name) && !leave_out.count(name))
      unexpected.push_back(detail::concat("blob \"", name, "\""));
  if (load_options.strict) {
    for (const auto& u : unexpected)
      differences.push_back(u +
                            " is in the checkpoint but the state does not have it (load with "
                            "strict = false to leave it out)");
  } else if (!unexpected.empty()) {
    std::string list;
    for (const auto& u : unexpected) list += (list.empty() ? "" : ", ") + u;
    log->warn(
        "loading checkpoint step {} (strict = false): left out {} the state does not have: {}",
        step, unexpected.size() == 1 ? "1 entry" : std::to_string(unexpected.size()) + " entries",
        list);
  }
  if (!differences.empty()) {
    std::string list;
    for (const auto& d : differences) list += "\n  " + d;
    throw InvalidArgument(detail::concat("cannot load checkpoint step ", step, " from ",
                                         dir.string(), ": ", differences.size(),
                                         " difference(s) from the state asked for:", list));
  }
  StepReader reader(storage, dir, std::move(manifest), read_options());
  at::NoGradGuard no_grad;
  // Contiguous CPU tensors are read straight into place, all in one pipeline.
  std::vector<StepReader::Request> in_place;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    at::Tensor& t = state.tensors[i].tensor;
    const auto& [record, region] = plan[i];
    if (t.device().is_cpu() && t.is_contiguous())
      add_reads(in_place, record, region, static_cast<char*>(t.data_ptr()), t.element_size());
  }
  reader.read(in_place, load_options.verify);
  // The others one at a time through a host tensor.
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    at::Tensor& t = state.tensors[i].tensor;
    if (t.device().is_cpu() && t.is_contiguous()) continue;
    const auto& [record, region] = plan[i];
    at::Tensor target;
    if (t.is_cuda()) {
      // Through the reused pinned buffer: the host-to-device copy below is one DMA.
      const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (load_buffer.size() < bytes) {
        load_buffer = internal::HostBuffer();
        load_buffer = internal::HostBuffer(bytes, /*pinned=*/true);
      }
      target = at::from_blob(load_buffer.data(), t.sizes(), t.options().device(at::kCPU));
    } else {
      target = at::empty(t.sizes(), t.options().device(at::kCPU));
    }
    std::vector<StepReader::Request> reads;
    add_reads(reads, record, region, static_cast<char*>(target.data_ptr()), target.element_size());
    reader.read(reads, load_options.verify);
    t.copy_(target);
  }
  for (auto& [name, text] : state.blobs) text = reader.manifest().blobs.at(name);
  return step;
}

int64_t Checkpointer::load(int64_t step, State& state, const LoadOptions& options) {
  if (step == kLatest) {
    auto newest = latest();
    LOOM_CHECK(newest.has_value(), IoError, "no committed checkpoint in ",
               impl_->options.dir.string());
    step = *newest;
  }
  return impl_->load_step(step, state, options);
}

int64_t Checkpointer::load_latest_valid(State& state, const LoadOptions& options) {
  impl_->wait_retention();
  auto steps = committed_steps(*impl_->storage, impl_->options.dir);
  LOOM_CHECK(!steps.empty(), IoError, "no committed checkpoint in ", impl_->options.dir.string());
  std::exception_ptr newest_error;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    try {
      return impl_->load_step(*it, state, options);
    } catch (const CorruptData& e) {
      if (!newest_error) newest_error = std::current_exception();
      impl_->log->warn("checkpoint step {} cannot be loaded ({}); trying the previous one", *it,
                       e.what());
    } catch (const IoError& e) {
      if (!newest_error) newest_error = std::current_exception();
      impl_->log->warn("checkpoint step {} cannot be loaded ({}); trying the previous one", *it,
                       e.what());
    }
  }
  std::rethrow_exception(newest_error);
}

}  // namespace loom::ckpt
