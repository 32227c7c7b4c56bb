// Runtime: the one object a training program builds. It knows this process's place in the
// job (rank, world size, local rank, coordinator), owns the configuration, the logger and the
// run directory, and has set the process-wide torch state (threads, seed, determinism).
// Later areas (collectives, data, checkpoints, control plane) attach to it.
//
//   int main(int argc, char** argv) {
//     return loom::run_main(argc, argv, my_keys(), [](loom::Runtime& rt) {
//       rt.log().info("rank {} of {}", rt.rank(), rt.world_size());
//     });
//   }
//
// Thread safety: after init a Runtime is read-only; its accessors may be called from any
// thread. It is movable, not copyable.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/config.h"
#include "loom/control/tls.h"
#include "loom/log.h"
#include "loom/visibility.h"

namespace loom {

namespace comm {
class Group;
class Store;
}  // namespace comm
namespace data {
class Mixture;
class Reader;
class ServiceReader;
struct MixtureOptions;
struct MixtureSource;
struct ReaderOptions;
}  // namespace data
namespace metrics {
struct StepMetrics;
}  // namespace metrics
namespace parallel {
class DeviceMesh;
}  // namespace parallel

// Where this process sits in the job. from_env() reads, first found wins:
//   rank               LOOM_RANK, RANK                          (default 0)
//   world_size         LOOM_WORLD_SIZE, WORLD_SIZE              (default 1)
//   local_rank         LOOM_LOCAL_RANK, LOCAL_RANK              (default 0)
//   local_world_size   LOOM_LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE  (default world_size)
//   coordinator        LOOM_COORDINATOR, else MASTER_ADDR:MASTER_PORT (default empty)
//   tls                LOOM_TLS_CERT, LOOM_TLS_KEY, LOOM_TLS_CA (default empty: plaintext)
// A value that is not an integer, or a rank outside [0, world_size), is InvalidArgument
// naming the variable.
struct LOOM_API Topology {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string coordinator;  // "host:port", empty for a single process started by hand
  int64_t generation = 0;   // LOOM_GENERATION: >= 1 under `loom run` (+1 per restart), else 0
  std::string job_token;    // LOOM_JOB_TOKEN: presented to the coordinator
  control::TlsFiles tls;    // how to reach the coordinator over TLS (`loom run --tls-*`)
  // LOOM_SNAPSHOT_DIR: memory (a tmpfs directory) that this node's `loom run` agent holds for
  // the job's in-memory snapshots; it outlives the worker processes, not the agent. Empty when
  // not under `loom run` (or started with --snapshots=off): train::Trainer then takes none.
  std::filesystem::path snapshot_dir;
  // LOOM_STORE_DIR: a directory every rank shares, for the rendezvous store of a job started
  // without `loom run` (a FileStore); empty: the coordinator's store, or none at world size 1.
  std::filesystem::path store_dir;
  // LOOM_ADVERTISE_ADDR: the address the other nodes reach this one by, which `loom run` sets;
  // empty: 127.0.0.1 (one node).
  std::string advertise_addr;
  // LOOM_SERVICE_<NAME>: the endpoints ("host:port,host:port") of the job spec's services that
  // `loom run` gives a worker (its node's replicas), or that any launcher may set; keyed by the
  // variable's name (LOOM_SERVICE_NAME and LOOM_SERVICE_REPLICA, a service's own identity, are
  // left out). Runtime::service() reads them when not under `loom run`.
  std::map<std::string, std::string> services;

  // Every field from the environment, read once here: Runtime reads none later.
  static Topology from_env();
  void validate() const;
};

class LOOM_API Runtime {
 public:
  // The keys Runtime itself reads (run.*, log.*). Programs merge their own keys into these.
  static ConfigSchema schema();

  // Reads the topology from the environment and the configuration from argv (see Config),
  // with `program_keys` declared beside Runtime's own keys. --help throws HelpRequested.
  static Runtime init(int argc, const char* const* argv, const ConfigSchema& program_keys = {});

  // For tests and embedders: explicit topology and configuration. `configure_process` = false
  // leaves torch's global state (threads, seed) alone, for ranks run as threads in one process.
  static Runtime init(const Config& config, const Topology& topology,
                      bool configure_process = true);

  // What an embedder (or a test running ranks as threads) brings instead of what Runtime would
  // build. Destroying one needs loom/comm/group.h (the groups are owned).
  struct Attachments {
    comm::Store* store = nullptr;  // used as store(); not owned, must outlive the Runtime
    std::unique_ptr<comm::Group> world_group;    // used as world_group(); null = built
    std::unique_ptr<comm::Group> control_group;  // used as control_group(); null = built
  };
  static Runtime init(const Config& config, const Topology& topology, bool configure_process,
                      Attachments attachments);

  Runtime(Runtime&&) noexcept;
  Runtime& operator=(Runtime&&) noexcept;
  ~Runtime();

  int rank() const;
  int world_size() const;
  int local_rank() const;
  int local_world_size() const;
  bool is_main() const { return rank() == 0; }
  const std::string& coordinator() const;
  const Topology& topology() const;

  // cpu, or cuda:<local_rank> when run.device is "cuda" or "auto" and CUDA is available.
  c10::Device device() const;
  // The base seed (run.seed). torch's global generator is seeded with it on every rank, so
  // models initialise identically; rank_seed() differs per rank for per-rank randomness.
  uint64_t seed() const;
  uint64_t rank_seed() const;
  // Intra-op threads torch was set to use.
  int threads() const;

  const Config& config() const;
  // Created at init; rank 0 writes the resolved config.toml there.
  const std::filesystem::path& run_dir() const;
  spdlog::logger& log() const;

  // Opens the dataset at `dir` for this rank: a directory, or a registry name such as
  // "kjv@3" (loom/data/registry.h; resolved through options.registry or
  // $LOOM_DATA_REGISTRY). options.rank and options.world_size are set from the topology:
  // every rank, or under model parallelism (parallel.pp or parallel.tp above 1) the mesh's dp
  // dimension, so that the tensor- and pipeline-parallel ranks of a replica read the same
  // batches (then collective: it builds mesh()). Everything else is the caller's
  // (loom/data/reader.h). The errors are data::Reader's.
  // Rank 0 records the dataset and the options in <run_dir>/readers.json, from which
  // `loom data show|serve RUN_DIR` show what the run reads.
  std::unique_ptr<data::Reader> open_dataset(const std::filesystem::path& dir,
                                             data::ReaderOptions options) const;
  // The same for a mixture of datasets (loom/data/mixture.h), recorded the same way.
  std::unique_ptr<data::Mixture> open_mixture(std::vector<data::MixtureSource> sources,
                                              data::MixtureOptions options) const;

  // Batches of `dataset` from the data service named `service` (`loom data service` in the
  // job spec; loom/data/service.h): the same batches, bit for bit, as open_dataset(dataset,
  // options) gives, read and decoded in the service's processes. Its replicas are service(name),
  // asked again when every one has failed; requests carry the job token. The dataset's path
  // is the service's (the same on a shared file system). Errors: service()'s, then
  // data::ServiceReader's.
  std::unique_ptr<data::ServiceReader> open_data_service(const std::string& service,
                                                         const std::filesystem::path& dataset,
                                                         data::ReaderOptions options) const;

  // The job's rendezvous store, created on first use: under `loom run` the coordinator's
  // key-value store, its keys scoped to this generation; with LOOM_STORE_DIR a FileStore in
  // that directory (processes on one host); for a single process an in-memory store.
  // Otherwise (several ranks, no launcher) InvalidArgument saying how to start the job.
  comm::Store& store() const;
  // The tensor group: all ranks, created on first use over store(): Gloo on CPU, NCCL on
  // CUDA (whose ops take device tensors only). Gradients, parameters and other device tensors
  // travel here. Collective: every rank calls it. Its flight dumps go to <run_dir>/flight.
  comm::Group& world_group() const;
  // The control group: all ranks, always Gloo (CPU tensors), created on first use over
  // store() as a second group named "control", on CPU too. Host-side scalars and agreement
  // travel here (the Trainer's loss and stop flag, evaluation sums, DataParallel's
  // construction checks), never queued behind gradient buckets and legal beside NCCL.
  // Collective: every rank calls it. Its flight dumps go to <run_dir>/flight/control.
  comm::Group& control_group() const;
  // The pp x dp x tp mesh over world_group() that parallel.pp, parallel.dp and parallel.tp
  // ask for (loom/parallel/mesh.h; parallel.dp = 0 takes the ranks pp and tp leave), created on
  // first use. Collective: every rank calls it. ConfigError naming the sizes and the world size
  // when they do not fit.
  parallel::DeviceMesh& mesh() const;
  // Under `loom run`: what the heartbeat (a background thread, once a second) reports to the
  // coordinator for dashboards and hang detection. Thread-safe; a no-op otherwise.
  void report_progress(int64_t step, double throughput,
                       const std::string& state = "training") const;
  // Under `loom run`: a finished step for the coordinator's job-wide metrics (Prometheus,
  // `loom top`, straggler detection; docs/observability.md), and the progress above.
  // metrics::MetricsLogger::log_step calls it; a loop without one may. Thread-safe; a no-op
  // otherwise.
  void report_step(const metrics::StepMetrics& step) const;
  // The endpoints ("host:port", or "host" for a service without a port) of every replica of
  // the job spec's service `name`, in replica order (docs/launcher.md, "Job specs"). Under
  // `loom run` (or with an attached store) from the coordinator's store, unscoped by generation:
  // the services of every node, as their supervisors published them (a restart publishes
  // again); otherwise from LOOM_SERVICE_<NAME> (Topology::services). Waits up to `timeout` for
  // replicas not yet published (a service still starting); Timeout naming the service and the
  // replicas missing then. A name the job has no service of is InvalidArgument naming it and
  // the services there are, at once when the job's list of services is published. Thread-safe.
  std::vector<std::string> service(
      const std::string& name, std::chrono::milliseconds timeout = std::chrono::seconds(30)) const;

 private:
  struct LOOM_HIDDEN Impl;
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The standard main: Runtime::init, then body(runtime). --help prints the usage to stdout and
// returns 0; a loom::ConfigError or InvalidArgument prints "error: ..." and returns 2; any other
// exception prints it and returns 1. Returns 0 when body returns.
LOOM_API int run_main(int argc, const char* const* argv, const ConfigSchema& program_keys,
                      const std::function<void(Runtime&)>& body);

}  // namespace loom
