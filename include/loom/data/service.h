// The data service: a dataset's batches read, decoded and collated in other processes (the
// CPU-heavy part of an input pipeline), served to trainers over gRPC.
//
// DataServer (what `loom data service` runs) answers "the batch after position P of dataset D
// read with options O" by running a data::Reader. The answer is a function of the request
// alone, so every replica gives the same bytes, and a restarted service or trainer continues
// exactly: data::ServiceReader, the trainer's side, keeps the position itself (it is a
// BatchSource like data::Reader, checkpointed by the Trainer the same way) and sends it with
// every request. When a replica fails, it asks the next; the batches do not change.
//
// A server keeps a few Readers per (dataset, options, rank) it was asked for, each positioned
// after the batch it last read; a request at another position restores one (O(1), nothing
// replayed). The trainer's side keeps a window of requests in flight, spread over the replicas,
// so batches are read ahead of need, by every replica at once.
//
//   server:  loom data service --port 7100
//   trainer: auto reader = rt.open_data_service("data", "kjv@3", {.batch_size = 8, ...});
//            // or data::ServiceReader("kjv@3", options, {.endpoints = {"host:7100"}})
//
// Built without gRPC (LOOM_WITH_GRPC=OFF) both are InvalidArgument saying so.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/data/batch.h"
#include "loom/data/reader.h"
#include "loom/visibility.h"

namespace loom::data {

struct DataServerOptions {
  std::string address = "0.0.0.0:0";  // host:port to listen on; port 0: any free port
  // Every request must carry this token ("loom-token" metadata) when it is not empty;
  // `loom data service` takes $LOOM_JOB_TOKEN, which `loom run` gives its services and workers.
  std::string token;
  // Readers of one (dataset, options, rank): requests for different batches of it (a
  // trainer's prefetch window) are read at once, each by its own Reader.
  int readers_per_client = 4;
  // Readers kept open in all; the least recently used idle ones are closed beyond this.
  int max_readers = 256;
};

struct DataServerStats {
  int64_t batches = 0;   // batches sent
  int64_t restores = 0;  // requests at a position other than the one a Reader was at
  int64_t readers = 0;   // Readers opened (closed ones included)
  int64_t bytes = 0;     // tensor bytes sent
};

// Serves batches until destroyed (or shutdown()). Thread-safe; requests are answered by gRPC's
// threads, one at a time per Reader. IoError when the address cannot be listened on.
class LOOM_API DataServer {
 public:
  explicit DataServer(DataServerOptions options);
  ~DataServer();
  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // host:port, with the port actually bound.
  const std::string& address() const;
  DataServerStats stats() const;
  // Stops answering; requests in flight finish. Idempotent.
  void shutdown();

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

struct ServiceReaderOptions {
  // The replicas' host:port. Requests go round the replicas, starting at replica rank % size
  // (spreading the trainers over them), each moving to the next replica when one fails.
  std::vector<std::string> endpoints;
  // Called for fresh endpoints after every replica failed once (a restarted replica may have
  // moved); null: the endpoints above stay. Runtime::open_data_service passes rt.service(name).
  std::function<std::vector<std::string>()> resolve;
  std::string service = "data";  // the service's name, for errors
  std::string token;             // sent as "loom-token"; $LOOM_JOB_TOKEN under `loom run`
  // One request's deadline: a replica that does not answer within it (a hung process) is
  // skipped for the next.
  std::chrono::milliseconds request_timeout{30000};
  // How long next() keeps trying replicas before CommError naming the service and every
  // replica with its failure.
  std::chrono::milliseconds deadline{120000};
  // Batches requested ahead while the trainer uses this one, spread over the replicas (each
  // request names its batch as "k batches after position P", so every replica can answer any
  // of them); 0: each next() asks for its batch and waits.
  int prefetch = 2;
};

struct ServiceReaderStats {
  int64_t batches = 0;
  int64_t failovers = 0;    // requests answered by another replica after one failed
  std::string replica;      // the replica that answered last
  double wait_seconds = 0;  // time next() spent waiting for a batch
};

// A BatchSource whose batches come from a data service: the same batches, bit for bit, as a
// data::Reader of `dataset` with `options` (options.rank and world_size included), whichever
// replica answers. Its state is the Reader's (state_json() is SamplerState's JSON, so a
// checkpoint of a ServiceReader resumes in a Reader and the other way round).
//
// Errors: a replica's answer that the dataset or options are bad is that error (InvalidArgument,
// IoError, CorruptData naming the replica), not retried elsewhere; a batch whose bytes do not
// match the service's checksum is CorruptData naming the replica; no replica answering within
// options.deadline is CommError naming the service and each replica's failure.
class LOOM_API ServiceReader final : public BatchSource {
 public:
  // Asks the service for the dataset's start (so a bad dataset or option is an error here, not
  // at the first step), then prefetches the first batch.
  ServiceReader(std::string dataset, ReaderOptions options, ServiceReaderOptions service);
  ~ServiceReader() override;
  ServiceReader(const ServiceReader&) = delete;
  ServiceReader& operator=(const ServiceReader&) = delete;

  Batch next() override;
  int64_t batch_size() const override;
  std::string state_json() const override;
  void restore_json(const std::string& json) override;

  const ReaderOptions& options() const;
  ServiceReaderStats stats() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::data
