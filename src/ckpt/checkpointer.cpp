// The asynchronous checkpointer (see loom/ckpt/checkpointer.h and docs/checkpoint.md).
//
// A save: the training thread plans this rank's file (layout.h), copies the tensors into
// one reusable staging buffer laid out exactly like the file, and queues a Job. CUDA tensors
// go into pinned staging memory by device-to-host copies on a side stream (device_copy.h),
// enqueued at save() and overlapping the next forward/backward; the deferred copy() then only
// makes the compute stream wait for them, and the writer waits for their event before it
// reads the buffer. The writer
// thread hashes the pieces, writes the file under a temporary name in large writes, fsyncs,
// renames, fsyncs the directory and reports through the Store under <prefix>/<step>/:
//   rank_<r>   "ok\n<report JSON>", "error\n<cause>" or "skipped\n<why>" (ranks 1..W-1)
//   commit     "ok", "error\n<cause>" or "skipped\n<why>", set by rank 0 after it wrote the
//              manifest (or decided not to); ranks 1..W-1 wait for it
//   finished   a counter; the rank that brings it to W removes the step's keys.
#include "loom/ckpt/checkpointer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "ckpt/device_copy.h"
#include "ckpt/layout.h"
#include "ckpt/manifest.h"
#include "ckpt/reader.h"
#include "ckpt/storage.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/hash.h"

namespace loom::ckpt {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// "ok\n..." -> {"ok", "..."}.
std::pair<std::string, std::string> split_status(const std::string& value) {
  size_t newline = value.find('\n');
  if (newline == std::string::npos) return {value, ""};
  return {value.substr(0, newline), value.substr(newline + 1)};
}

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

}  // namespace

// One save, shared by the training thread, the writer thread and the handles.
struct SaveHandle::Job {
  // Constant after construction.
  int64_t step = 0;
  FilePlan plan;
  Manifest report;  // this rank's report, hashes filled in by the writer
  char* staging = nullptr;
  // The device-to-host copies of the CUDA pieces, enqueued by save(); null without any.
  std::shared_ptr<internal::CopyFence> fence;

  // State below is protected by mutex; changed is notified when copied or finished turn true.
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<at::Tensor> pending;  // the tensors to copy (one per planned piece) until copied
  bool copied = false;
  std::exception_ptr copy_error;
  bool finished = false;
  bool skipped = false;
  std::exception_ptr error;

  // Copies the pending tensors into staging once; later calls return at once.
  void copy() {
    std::lock_guard<std::mutex> lock(mutex);
    if (copied) return;
    try {
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
          // memcpy in 8 MiB blocks over torch's intra-op threads: training is stalled anyway.
          const char* from = static_cast<const char*>(src.data_ptr());
          char* to = staging + p.offset;
          at::parallel_for(
              0, static_cast<int64_t>(p.bytes), int64_t{8} << 20, [&](int64_t begin, int64_t end) {
                std::memcpy(to + begin, from + begin, static_cast<size_t>(end - begin));
              });
        } else {  // strided or on a device: torch copies (and moves to the CPU)
          at::from_blob(staging + p.offset, src.sizes(), src.options().device(at::kCPU)).copy_(src);
        }
      }
      // The caller may change the CUDA tensors once copy() returned: later work on the compute
      // stream waits for their copies (on the GPU; the host goes on).
      if (fence) fence->order_compute_stream();
    } catch (...) {
      copy_error = std::current_exception();
    }
    pending.clear();
    copied = true;
    changed.notify_all();
  }

  void wait_copied() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return copied; });
  }

  // The writer thread, before it reads staging: blocks until the device copies have landed.
  void wait_device_copies() {
    if (!fence) return;
    try {
      fence->wait();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!copy_error) copy_error = std::current_exception();
    }
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
        log(options.logger ? options.logger : spdlog::default_logger()) {}

  // Constant after construction.
  comm::Store& store;
  const CheckpointerOptions options;
  const std::shared_ptr<Storage> storage;
  const std::shared_ptr<spdlog::logger> log;

  // Touched by the training thread only (and the destructor).
  std::shared_ptr<Job> current;      // the newest save, maybe in flight
  std::optional<int64_t> last_step;  // the step of the newest save() that got past validation
  internal::HostBuffer staging;      // reused by every save; grown when a file needs more
  bool staging_pin_asked = false;    // staging was allocated for CUDA tensors (pinned if it could)
  std::unique_ptr<internal::DeviceStager> stager;  // made at the first save of a CUDA tensor
  internal::HostBuffer load_buffer;  // pinned, reused: reads of CUDA tensors land here first

  // State below is protected by mutex; wake is notified when queued, stop or retiring change.
  std::mutex mutex;
  std::condition_variable wake;
  std::shared_ptr<Job> queued;
  bool stop = false;
  bool retiring = false;  // rank 0's writer is applying retention after a commit

  std::thread writer;  // started last in the constructor

  std::string key(int64_t step, const std::string& name) const {
    return detail::concat(options.store_prefix, "/", step, "/", name);
  }
  std::filesystem::path step_dir(int64_t step) const { return options.dir / step_dir_name(step); }

  void writer_loop();
  void run_job(Job& job);
  void write_file(Job& job);
  // Rank 0: collects the reports, writes the manifest, sets commit.
  // Returns true when the step was skipped.
  bool commit(Job& job);
  void write_manifest(int64_t step, const Manifest& manifest);
  void apply_retention(int64_t step);
  void finish_keys(int64_t step);
  void wait_retention();
  int64_t load_step(int64_t step, State& state, const LoadOptions& options);
};

void Checkpointer::Impl::writer_loop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stop || queued; });
      if (!queued) return;
      job = std::move(queued);
    }
    job->wait_copied();
    job->wait_device_copies();
    run_job(*job);
  }
}

void Checkpointer::Impl::run_job(Job& job) {
  const int rank = options.rank;
  bool skipped = false;
  std::exception_ptr failure;
  try {
    std::exception_ptr copy_error;
    {
      std::lock_guard<std::mutex> lock(job.mutex);
      copy_error = job.copy_error;
    }
    if (copy_error) std::rethrow_exception(copy_error);
    write_file(job);
  } catch (...) {
    failure = std::current_exception();
    // Tell rank 0 (or, on rank 0, everyone) so that nothing is committed and nobody hangs.
    const std::string cause = detail::concat("error\nrank ", rank, " could not write its file ",
                                             (step_dir(job.step) / data_file_name(rank)).string(),
                                             ": ", what_of(failure));
    try {
      store.set(key(job.step, rank == 0 ? "commit" : detail::concat("rank_", rank)), cause);
    } catch (const std::exception& e) {
      log->error("checkpoint step {}: could not report the failure to the store: {}", job.step,
                 e.what());
    }
  }
  if (!failure) {
    try {
      if (rank == 0) {
        skipped = commit(job);
      } else {
        store.set(key(job.step, detail::concat("rank_", rank)), "ok\n" + to_json(job.report));
        const auto [status, detail_text] =
            split_status(store.get(key(job.step, "commit"), options.timeout));
        if (status == "skipped") {
          skipped = true;
        } else if (status != "ok") {
          throw IoError(
              detail::concat("checkpoint step ", job.step, " was not committed: ", detail_text));
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (skipped) log->warn("checkpoint step {} was skipped: a rank was still saving", job.step);
  try {
    finish_keys(job.step);
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
  // capacity, a multiple of the alignment) and the file truncated back afterwards.
  const uint64_t padded = file->direct() ? (job.plan.file_bytes + kDirectAlignment - 1) /
                                               kDirectAlignment * kDirectAlignment
                                         : job.plan.file_bytes;
  if (padded > job.plan.file_bytes)
    std::memset(job.staging + job.plan.file_bytes, 0, padded - job.plan.file_bytes);
  // One pass over the staging buffer in file order: hash a chunk (per chunk, and into its
  // piece's hash), and once write_bytes are hashed, write them and start their writeback, so
  // the disk works while the next chunks are hashed and the final fsync has little left.
  uint64_t written = 0;
  auto write_up_to = [&](uint64_t end, bool last) {
    while (end - written >= options.write_bytes || (last && written < end)) {
      const uint64_t n = std::min<uint64_t>(options.write_bytes, end - written);
      write_all(*file, job.staging + written, n);
      file->start_writeback(written, n);
      written += n;
    }
  };
  std::vector<Piece*> pieces;  // the report's pieces are in plan (= file) order
  for (auto& t : job.report.tensors)
    for (auto& piece : t.pieces) pieces.push_back(&piece);
  for (size_t i = 0; i < job.plan.pieces.size(); ++i) {
    const PlannedPiece& p = job.plan.pieces[i];
    Piece& piece = *pieces[i];
    const char* bytes = job.staging + p.offset;
    piece.chunk_hashes.clear();
    for (uint64_t cs = 0; cs < p.bytes; cs += piece.chunk_bytes) {
      const uint64_t n = std::min<uint64_t>(piece.chunk_bytes, p.bytes - cs);
      piece.chunk_hashes.push_back(util::xxh64(bytes + cs, n));
      write_up_to(p.offset + cs + n, false);
    }
    piece.hash = piece_hash(piece.chunk_hashes);
  }
  write_up_to(padded, true);
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

bool Checkpointer::Impl::commit(Job& job) {
  const auto deadline = Clock::now() + options.timeout;
  std::vector<Manifest> reports{job.report};
  std::string failure, skip;
  try {
    for (int r = 1; r < options.world_size; ++r) {
      const auto [status, body] =
          split_status(store.get(key(job.step, detail::concat("rank_", r)), remaining(deadline)));
      if (status == "ok") {
        reports.push_back(parse_manifest(body, detail::concat("rank ", r, "'s report")));
      } else if (status == "skipped") {
        if (skip.empty()) skip = detail::concat("rank ", r, ": ", body);
      } else if (failure.empty()) {
        failure = body;
      }
    }
  } catch (const std::exception& e) {  // a rank that never reported: the others fail fast too
    store.set(key(job.step, "commit"), detail::concat("error\nrank 0: ", e.what()));
    throw;
  }
  if (!failure.empty() || !skip.empty()) {
    store.set(key(job.step, "commit"), failure.empty() ? "skipped\n" + skip : "error\n" + failure);
    if (failure.empty()) return true;
    throw IoError(detail::concat("checkpoint step ", job.step, " was not committed: ", failure));
  }
  try {
    Manifest manifest = merge_reports(job.step, reports);
    write_manifest(job.step, manifest);
  } catch (const std::exception& e) {
    store.set(key(job.step, "commit"),
              detail::concat("error\nrank 0 could not commit: ", e.what()));
    throw;
  }
  store.set(key(job.step, "commit"), "ok");
  return false;
}

void Checkpointer::Impl::write_manifest(int64_t step, const Manifest& manifest) {
  const auto dir = step_dir(step);
  const auto temp = dir / ("." + std::string(kManifestName) + ".tmp");
  const std::string text = to_json(manifest);
  {
    auto file = storage->create(temp);
    write_all(*file, text.data(), text.size());
    file->sync();
  }
  storage->rename(temp, dir / kManifestName);
  storage->sync_dir(dir);
}

void Checkpointer::Impl::apply_retention(int64_t step) {
  const std::vector<int64_t> steps = committed_steps(options.dir);
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
  for (const auto& dir : uncommitted_dirs(options.dir))
    if (parse_step_dir_name(dir.filename().string()).value_or(step) < step)
      storage->remove_all(dir);
  storage->sync_dir(options.dir);
}

void Checkpointer::Impl::finish_keys(int64_t step) {
  if (store.add(key(step, "finished"), 1) < options.world_size) return;
  for (int r = 1; r < options.world_size; ++r) store.remove(key(step, detail::concat("rank_", r)));
  store.remove(key(step, "commit"));
  store.remove(key(step, "finished"));
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
                 options.hash_chunk_bytes >= 16,
             InvalidArgument,
             "CheckpointerOptions: write_bytes must be a positive multiple of 4096 and "
             "hash_chunk_bytes >= 16");
  LOOM_CHECK(storage != nullptr, InvalidArgument, "Checkpointer: storage is null");
  storage->create_dirs(options.dir);
  impl_ = std::make_unique<Impl>(store, std::move(options), std::move(storage));
  impl_->writer = std::thread([impl = impl_.get()] { impl->writer_loop(); });
}

Checkpointer::~Checkpointer() {
  if (impl_->current) {
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
}

const CheckpointerOptions& Checkpointer::options() const { return impl_->options; }

SaveHandle Checkpointer::save(int64_t step, const State& state, const SaveOptions& save_options) {
  Impl& m = *impl_;
  LOOM_CHECK(step >= 0, InvalidArgument, "checkpoint step must be >= 0, got ", step);
  FilePlan plan = plan_file(state, m.options.rank);  // validates before anything waits
  if (m.options.rank == 0) {
    for (const auto& [name, text] : state.blobs) {
      LOOM_CHECK(nlohmann::json::accept(text), InvalidArgument, "checkpoint blob \"", name,
                 "\" is not valid JSON");
    }
  }
  // Steps only grow within a run: retention and the commit protocol rely on it.
  LOOM_CHECK(!m.last_step || step > *m.last_step, InvalidArgument, "checkpoint step ", step,
             " was asked for after step ", m.last_step.value_or(0),
             "; steps must increase from save to save");

  auto job = std::make_shared<SaveHandle::Job>();
  job->step = step;
  // The previous save must be done with the staging buffer.
  if (m.current) {
    m.current->copy();
    if (!SaveHandle(m.current).done() && m.options.skip_if_busy) {
      m.log->warn("checkpoint step {} skipped: the save of step {} is still in flight", step,
                  m.current->step);
      const std::string why = detail::concat("skipped\nthe save of step ", m.current->step,
                                             " was still in flight on rank ", m.options.rank);
      m.store.set(
          m.key(step, m.options.rank == 0 ? "commit" : detail::concat("rank_", m.options.rank)),
          why);
      m.finish_keys(step);
      m.last_step = step;
      job->copied = true;
      job->finish(true, nullptr);
      return SaveHandle(job);
    }
    const auto deadline = Clock::now() + m.options.timeout;
    LOOM_CHECK(m.current->wait_finished(deadline), Timeout, "checkpoint step ", step,
               ": the save of step ", m.current->step, " did not finish within ",
               m.options.timeout.count(), " ms");
    m.current.reset();
  }
  LOOM_CHECK(!std::filesystem::exists(m.step_dir(step) / kManifestName), InvalidArgument,
             "checkpoint step ", step, " is already committed in ", m.options.dir.string(),
             "; save under a new step or remove that directory first");
  m.last_step = step;
  const bool on_device = std::any_of(plan.pieces.begin(), plan.pieces.end(), [&](const auto& p) {
    return state.tensors[p.entry].tensor.is_cuda();
  });
  if (plan.file_bytes > m.staging.size() || (on_device && !m.staging_pin_asked)) {
    // Allocated once and reused; pinned once a CUDA tensor is saved (DMA straight into it).
    const bool pin = on_device || m.staging_pin_asked;
    m.staging = internal::HostBuffer();
    m.staging = internal::HostBuffer(std::max<size_t>(plan.file_bytes, 1), pin);
    m.staging_pin_asked = pin;
  }
  job->staging = m.staging.data();

  // This rank's report: its file, one record per tensor it describes, pieces in plan order.
  Manifest& report = job->report;
  report.step = step;
  report.world_size = m.options.world_size;
  report.files.push_back({data_file_name(m.options.rank), m.options.rank, plan.file_bytes});
  if (m.options.rank == 0) report.blobs = state.blobs;
  size_t next_piece = 0;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const TensorEntry& e = state.tensors[i];
    if (e.sharding.kind == Sharding::Kind::kReplicated && m.options.rank != 0) continue;
    Region region = region_of(e);
    TensorRecord record{e.name,
                        dtype_name(e.tensor.scalar_type()),
                        region.global_shape,
                        kind_name(e.sharding.kind),
                        {}};
    if (next_piece < plan.pieces.size() && plan.pieces[next_piece].entry == i) {
      const PlannedPiece& p = plan.pieces[next_piece++];
      const uint64_t es = e.tensor.element_size();
      const uint64_t chunk = std::max<uint64_t>(es, m.options.hash_chunk_bytes / es * es);
      record.pieces.push_back({data_file_name(m.options.rank),
                               p.region.begin,
                               p.region.end,
                               p.offset,
                               p.bytes,
                               0,
                               chunk,
                               {}});
      job->pending.push_back(e.tensor);
    }
    report.tensors.push_back(std::move(record));
  }
  // CUDA pieces start copying now, on the side stream, whether or not the copy is deferred.
  for (size_t i = 0; i < job->pending.size(); ++i) {
    if (!job->pending[i].is_cuda()) continue;
    if (!m.stager) m.stager = internal::new_device_stager();
    m.stager->copy_to_host(job->pending[i], job->staging + plan.pieces[i].offset);
  }
  if (m.stager) job->fence = m.stager->fence();
  job->plan = std::move(plan);
  if (!save_options.defer_copy) job->copy();
  m.current = job;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.queued = job;
  }
  m.wake.notify_all();
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
  for (int64_t step : committed_steps(impl_->options.dir)) {
    const auto dir = impl_->step_dir(step);
    try {
      Manifest m = read_manifest(dir);
      out.push_back({step, dir, m.data_bytes(), m.world_size});
    } catch (const Error& e) {
      impl_->log->warn("checkpoint {}: unreadable manifest: {}", dir.string(), e.what());
    }
  }
  return out;
}

std::optional<int64_t> Checkpointer::latest() const {
  impl_->wait_retention();
  auto steps = committed_steps(impl_->options.dir);
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

void Checkpointer::verify(int64_t step) const {
  const auto dir = impl_->step_dir(step);
  StepReader reader(impl_->storage, dir, read_manifest(dir));
  reader.verify_all();
}

int64_t Checkpointer::Impl::load_step(int64_t step, State& state, const LoadOptions& load_options) {
  wait_retention();
  const auto dir = step_dir(step);
  LOOM_CHECK(std::filesystem::exists(dir / kManifestName), IoError, "checkpoint step ", step,
             " is not committed in ", options.dir.string(), " (no ", (dir / kManifestName).string(),
             ")");
  Manifest manifest = read_manifest(dir);
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
  StepReader reader(storage, dir, std::move(manifest));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    at::Tensor& t = state.tensors[i].tensor;
    const auto& [record, region] = plan[i];
    const bool direct = t.device().is_cpu() && t.is_contiguous();
    at::Tensor target = t;
    if (t.is_cuda()) {
      // Through the reused pinned buffer: the host-to-device copy below is one DMA.
      const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (load_buffer.size() < bytes) {
        load_buffer = internal::HostBuffer();
        load_buffer = internal::HostBuffer(bytes, /*pinned=*/true);
      }
      target = at::from_blob(load_buffer.data(), t.sizes(), t.options().device(at::kCPU));
    } else if (!direct) {
      target = at::empty(t.sizes(), t.options().device(at::kCPU));
    }
    reader.read(*record, region.begin, region.end, static_cast<char*>(target.data_ptr()),
                load_options.verify);
    if (!direct) t.copy_(target);
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
  auto steps = committed_steps(impl_->options.dir);
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
