// Weight snapshots to user processes: a trainer publishes its parameters as numbered versions;
// subscribers (an evaluator, RL rollout workers, any program) receive the newest complete one,
// never a torn one, each checked against its xxHash64.
//
//   // trainer, rank 0 (publish_parameters below gathers FSDP's shards first)
//   loom::control::WeightPublisher publisher("policy", {.listen = "0.0.0.0:0"});
//   publisher.publish(step, {{"w", w}, {"b", b}});
//
//   // another process on this host ("policy": shared memory) or elsewhere ("host:port": TCP)
//   loom::control::WeightSubscriber subscriber("policy");
//   loom::control::WeightVersion v = subscriber.latest(/*newer_than=*/last, 30s);
//
// Same host: one POSIX shared-memory segment, /dev/shm/loom-weights-<name>, holding the layout
// and `slots` versions, each under a sequence lock. A publish is one copy into the segment, however
// many subscribers read it; each subscriber copies the newest version out and retries a read
// the publisher overwrote meanwhile. Other hosts: the publisher's TCP listener streams the newest
// version on request, as a JSON header line and the raw bytes; any program can speak it
// (docs/launcher.md, "Weight snapshots", has the protocol and a Python client).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "loom/visibility.h"

namespace loom::parallel {
class Strategy;
}

namespace loom::control {

struct WeightPublisherOptions {
  // Versions the segment holds (3 to 64). A subscriber that copies a version out within
  // slots - 1 publishes never retries; a slower one retries, and times out if it never is.
  int slots = 3;
  // "" serves this host only (shared memory); "ADDRESS:PORT" (e.g. "0.0.0.0:0", port 0: any
  // free one) also serves over TCP: endpoint() says where.
  std::string listen;
  // TCP subscribers served at once; more are refused with a message that says so.
  int max_connections = 16;
};

// The owner of a name's segment and, with `listen`, of a TCP listener thread.
// Thread safety: publish() from one thread at a time; endpoint(), segment_path() and
// latest_version() from any thread. The listener thread reads the segment only.
class LOOM_API WeightPublisher {
 public:
  // Claims /dev/shm/loom-weights-<name>: a segment a dead publisher left is removed (logged),
  // one a live publisher holds is InvalidArgument naming its pid. `name`: 1 to 200 characters of
  // [A-Za-z0-9._-], not starting with '.'. The segment itself is created at the first publish
  // (its size is the layout's). With `listen`, binds it (IoError naming the address).
  explicit WeightPublisher(std::string name, WeightPublisherOptions options = {});
  // Marks the segment closed, removes it and stops the listener (subscribers then get an error
  // naming this publisher).
  ~WeightPublisher();
  WeightPublisher(const WeightPublisher&) = delete;
  WeightPublisher& operator=(const WeightPublisher&) = delete;

  // Publishes `tensors` (any device; their bytes as they are, dtypes kept) as `version`, which
  // must be greater than every version published before (>= 0). The layout (names, dtypes,
  // shapes) is fixed by the first publish; a later different one is InvalidArgument naming the
  // tensor. Returns once the version is complete and visible to subscribers: one copy into the
  // segment plus its xxHash64. Never waits for a subscriber.
  void publish(int64_t version, const std::map<std::string, at::Tensor>& tensors);

  // "HOST:PORT" of the TCP listener (the bound address; 0.0.0.0 names this host's name), or ""
  // without `listen`.
  std::string endpoint() const;
  // "/dev/shm/loom-weights-<name>".
  std::string segment_path() const;
  // The newest published version, -1 before the first.
  int64_t latest_version() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

// One received version: the tensors are the subscriber's own (CPU, contiguous).
struct WeightVersion {
  int64_t version = -1;
  uint64_t checksum = 0;  // xxHash64 of the tensors' bytes, in name order, as published
  std::map<std::string, at::Tensor> tensors;
  int64_t torn_reads = 0;  // reads of this call that the publisher overwrote and were retried
};

struct WeightSubscriberOptions {
  // TCP: the longest a transfer may go without progress before it is a CommError.
  std::chrono::milliseconds io_timeout{10000};
  // TCP: the most bytes a version may claim before anything is allocated for it.
  int64_t max_bytes = int64_t{1} << 40;
};

// Reads one publisher: `source` is a name (shared memory on this host) or "HOST:PORT" (TCP).
// Not thread-safe: one thread at a time. The publisher need not exist yet: every call waits for
// it up to its timeout.
class LOOM_API WeightSubscriber {
 public:
  explicit WeightSubscriber(std::string source, WeightSubscriberOptions options = {});
  ~WeightSubscriber();
  WeightSubscriber(const WeightSubscriber&) = delete;
  WeightSubscriber& operator=(const WeightSubscriber&) = delete;

  // The newest complete version greater than `newer_than`, waiting up to `timeout` for one.
  // Verified against its checksum; a read the publisher overwrote is retried, never returned.
  // Errors: Timeout naming the source and the newest version it has (or that there is no
  // publisher, or that it closed or died, and what to do); CorruptData for a version whose bytes
  // do not match its checksum or a segment or reply that is not Loom's format; CommError for a
  // TCP peer that failed mid-transfer.
  WeightVersion latest(int64_t newer_than = -1,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // The same into `into`: when into.tensors already has the published layout (names, dtypes,
  // shapes; contiguous CPU tensors), the bytes are copied into those tensors (no allocation, e.g.
  // a model's parameters), else they are replaced by new tensors. On an exception their
  // contents are unspecified.
  void latest_into(WeightVersion& into, int64_t newer_than = -1,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // Torn reads retried over this subscriber's life.
  int64_t torn_reads() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

// Publishes the model's full parameters, by the module's names, as `version`: `publisher` on
// the rank that publishes (usually rank 0), nullptr on the others. Under FSDP it gathers the
// shards, which is collective: every rank calls it at the same step. DataParallel (DDP, ZeRO-1/2)
// holds them whole on every rank and sends nothing. Under tensor or pipeline parallelism
// (ModelParallel active) a rank holds pieces only: InvalidArgument; publish each model-parallel
// rank's own parameters under a name of its own instead. From a Trainer, every N steps:
//   callbacks.on_step_end = [&](const loom::train::StepInfo& info) {
//     if ((info.step + 1) % N == 0) publish_parameters(strategy, publisher.get(), info.step + 1);
//   };
LOOM_API void publish_parameters(parallel::Strategy& strategy, WeightPublisher* publisher,
                                 int64_t version);

}  // namespace loom::control
