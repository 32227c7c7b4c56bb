// Runtime: topology from the environment, configuration, run directory, logger, and the
// process-wide torch settings (threads, seed, determinism).
#include "loom/runtime.h"

#include <unistd.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

#include "control/heartbeat.h"
#include "control/service_keys.h"
#include "data/run_readers.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/gloo.h"
#include "loom/comm/group.h"
#include "loom/comm/nccl.h"
#include "loom/comm/store.h"
#include "loom/control/store.h"
#include "loom/data/mixture.h"
#include "loom/data/reader.h"
#include "loom/data/service.h"
#include "loom/error.h"
#include "loom/metrics/logger.h"
#include "loom/parallel/mesh.h"
#include "loom/parallel/pipeline.h"
#include "loom/version.h"
#include "metrics/activity.h"
#include "metrics/stacks.h"
#include "util/files.h"
#include "util/malloc_tuning.h"
#include "util/mix.h"

namespace loom {
namespace {

// The integer in the first of `names` that is set; nullopt when none is.
std::optional<int> env_int(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') continue;
    char* end = nullptr;
    errno = 0;
    long value = std::strtol(text, &end, 10);
    LOOM_CHECK(errno == 0 && *end == '\0' && value >= 0 && value <= (1 << 24), InvalidArgument,
               "environment variable ", name, "='", text, "' is not a non-negative integer");
    return static_cast<int>(value);
  }
  return std::nullopt;
}

std::string env_str(const char* name) {
  const char* text = std::getenv(name);
  return text == nullptr ? std::string() : std::string(text);
}

// Threads for torch's intra-op pool: run.threads, or the machine's cores shared evenly
// among the ranks on this host.
int choose_threads(int configured, int local_world_size) {
  if (configured > 0) return configured;
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, local_world_size));
}

c10::Device choose_device(const std::string& wanted, int local_rank) {
  if (wanted == "cpu") return c10::Device(c10::kCPU);
  LOOM_CHECK(wanted == "auto" || wanted == "cuda", ConfigError, "config key 'run.device' is '",
             wanted, "': use auto, cpu or cuda");
  bool cuda = torch::cuda::is_available();
  if (wanted == "cuda") {
    LOOM_CHECK(cuda, InvalidArgument,
               "run.device=cuda but no CUDA device is available (libtorch built without CUDA, "
               "or no GPU visible); use run.device=cpu or auto");
  }
  if (!cuda) return c10::Device(c10::kCPU);
  int count = static_cast<int>(torch::cuda::device_count());
  LOOM_CHECK(local_rank < count, InvalidArgument, "local rank ", local_rank, " needs GPU ",
             local_rank, " but only ", count, " are visible; start at most ", count,
             " processes per node");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

// A well-mixed per-rank seed from the base seed.
uint64_t mix_seed(uint64_t seed, uint64_t rank) { return util::splitmix64(seed, rank); }

}  // namespace

Topology Topology::from_env() {
  Topology t;
  t.rank = env_int({"LOOM_RANK", "RANK"}).value_or(0);
  t.world_size = env_int({"LOOM_WORLD_SIZE", "WORLD_SIZE"}).value_or(1);
  t.local_rank = env_int({"LOOM_LOCAL_RANK", "LOCAL_RANK"}).value_or(0);
  t.local_world_size =
      env_int({"LOOM_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"}).value_or(t.world_size);
  t.coordinator = env_str("LOOM_COORDINATOR");
  t.generation = env_int({"LOOM_GENERATION"}).value_or(0);
  t.job_token = env_str("LOOM_JOB_TOKEN");
  t.tls = {env_str("LOOM_TLS_CERT"), env_str("LOOM_TLS_KEY"), env_str("LOOM_TLS_CA")};
  t.snapshot_dir = env_str("LOOM_SNAPSHOT_DIR");
  t.store_dir = env_str("LOOM_STORE_DIR");
  t.advertise_addr = env_str("LOOM_ADVERTISE_ADDR");
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    const auto eq = var.find('=');
    const std::string key = var.substr(0, eq);
    if (key.rfind("LOOM_SERVICE_", 0) != 0 || eq == std::string::npos) continue;
    if (key == "LOOM_SERVICE_NAME" || key == "LOOM_SERVICE_REPLICA") continue;
    t.services[key] = var.substr(eq + 1);
  }
  if (t.coordinator.empty() && !env_str("MASTER_ADDR").empty()) {
    std::string port = env_str("MASTER_PORT");
    LOOM_CHECK(!port.empty(), InvalidArgument, "MASTER_ADDR is set but MASTER_PORT is not");
    t.coordinator = env_str("MASTER_ADDR") + ":" + port;
  }
  t.validate();
  return t;
}

void Topology::validate() const {
  LOOM_CHECK(world_size >= 1, InvalidArgument, "world size must be at least 1, got ", world_size);
  LOOM_CHECK(rank >= 0 && rank < world_size, InvalidArgument, "rank ", rank, " is outside [0, ",
             world_size, "): check LOOM_RANK/RANK and LOOM_WORLD_SIZE");
  LOOM_CHECK(local_world_size >= 1 && local_rank >= 0 && local_rank < local_world_size,
             InvalidArgument, "local rank ", local_rank, " is outside [0, ", local_world_size,
             "): check LOOM_LOCAL_RANK and LOOM_LOCAL_WORLD_SIZE");
}

struct Runtime::Impl {
  // Constant after construction.
  Topology topology;
  Config config;
  std::filesystem::path run_dir;
  std::shared_ptr<spdlog::logger> logger;
  c10::Device device{c10::kCPU};
  uint64_t seed = 0;
  int threads = 1;
  std::unique_ptr<control::Heartbeat> heartbeat;  // under `loom run` only

  // Created on first use (or attached at init), one at a time under create_mutex (a group's
  // creation connects to every peer, for up to minutes); the pointers are read and set under
  // mutex, which is never held while connecting, so that the heartbeat thread's dump_flight
  // does not wait for a connection.
  std::mutex create_mutex;
  std::mutex mutex;
  std::unique_ptr<comm::Store> base_store;
  bool store_attached = false;  // constant after construction
  std::unique_ptr<comm::Store> owned_store;
  comm::Store* store = nullptr;  // owned_store, or an attached one
  std::unique_ptr<comm::Group> world_group;
  std::unique_ptr<comm::Group> control_group;
  std::unique_ptr<parallel::DeviceMesh> mesh;  // its groups are world_group's subgroups

  ~Impl() {
    heartbeat.reset();  // its thread may call dump_flight
    mesh.reset();
    control_group.reset();
    world_group.reset();  // before the stores they bootstrapped over
  }

  std::filesystem::path flight_dir(bool control) const {
    return control ? run_dir / "flight" / "control" : run_dir / "flight";
  }

  // The oldest collective in flight on the world or control group, for the heartbeat:
  // "all_reduce #83 on world (float32 x 4096), started 12.3 s ago"; "" when none.
  std::string collective_in_flight() {
    std::lock_guard<std::mutex> lock(mutex);
    std::optional<comm::FlightEntry> oldest;
    const comm::Group* owner = nullptr;
    for (const comm::Group* group : {world_group.get(), control_group.get()}) {
      if (group == nullptr) continue;
      for (comm::FlightEntry& e : group->flight_recorder().snapshot()) {
        if (e.state != comm::OpState::kEnqueued && e.state != comm::OpState::kStarted) continue;
        if (!oldest || e.enqueue_us < oldest->enqueue_us) {
          oldest = std::move(e);
          owner = group;
        }
        break;  // the group's oldest in flight
      }
    }
    if (!oldest) return "";
    const bool started = oldest->state == comm::OpState::kStarted;
    const int64_t since = started ? oldest->start_us : oldest->enqueue_us;
    const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    return fmt::format("{} #{} on {} ({} x {}), {} {:.1f} s ago", oldest->op, oldest->sequence,
                       owner->name(), oldest->dtype.empty() ? "-" : oldest->dtype, oldest->numel,
                       started ? "started" : "enqueued", static_cast<double>(now_us - since) / 1e6);
  }

  // Writes the groups' flight recorders to <run_dir>/flight and every thread's stack to
  // <run_dir>/stacks/rank_<r>.txt (a coordinator request: a failure or a hang).
  void dump_flight() {
    try {
      const auto file = run_dir / "stacks" / fmt::format("rank_{}.txt", topology.rank);
      std::filesystem::create_directories(file.parent_path());
      util::write_file_atomic(file, metrics::thread_stacks(), util::Durability::kAtomicOnly);
      logger->info("thread stacks written to {} (coordinator request)", file.string());
    } catch (const std::exception& e) {
      logger->warn("could not write the thread stacks: {}", e.what());
    }
    std::lock_guard<std::mutex> lock(mutex);
    for (const bool control : {false, true}) {
      const comm::Group* group = control ? control_group.get() : world_group.get();
      if (group == nullptr) continue;
      const auto file = comm::flight_dump_file(flight_dir(control), topology.rank);
      std::filesystem::create_directories(file.parent_path());
      group->flight_recorder().dump(file, topology.rank, group->name());
      logger->info("flight recorder dumped to {} (coordinator request)", file.string());
    }
  }
};

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::Runtime(Runtime&&) noexcept = default;
Runtime& Runtime::operator=(Runtime&&) noexcept = default;
Runtime::~Runtime() = default;

ConfigSchema Runtime::schema() {
  ConfigSchema s;
  s.add("run.dir", "runs/default",
        "run directory: logs, resolved config, metrics and checkpoints go here");
  s.add("run.seed", int64_t{1234}, "base random seed; the same on every rank");
  s.add("run.threads", 0, "torch intra-op threads per rank; 0 = cores / ranks on this host");
  s.add("run.device", "auto", "auto (cuda:<local_rank> when available, else cpu), cpu or cuda");
  s.add("run.deterministic", false, "make torch use deterministic algorithms only");
  s.add("run.keep_freed_memory", true,
        "keep freed memory in the process (glibc: allocations up to 32 MiB from the heap, no "
        "trimming) instead of returning it and faulting it in again every step");
  s.add("log.level", "info", "trace, debug, info, warn, error or off");
  s.add("log.to_file", true, "also write <run.dir>/logs/rank_<r>.log");
  s.add("comm.shared_memory", true,
        "CPU collectives through shared memory when every rank is on one host (false: loopback "
        "TCP)");
  s.merge(parallel::mesh_schema());
  s.merge(parallel::pipeline_schema());
  return s;
}

Runtime Runtime::init(int argc, const char* const* argv, const ConfigSchema& program_keys) {
  ConfigSchema keys = schema();
  keys.merge(program_keys);
  Topology topology = Topology::from_env();
  return init(Config::from_args(keys, argc, argv), topology);
}

Runtime Runtime::init(const Config& config, const Topology& topology, bool configure_process) {
  return init(config, topology, configure_process, Attachments{});
}

Runtime Runtime::init(const Config& config, const Topology& topology, bool configure_process,
                      Attachments attachments) {
  topology.validate();
  for (const comm::Group* group :
       {attachments.world_group.get(), attachments.control_group.get()}) {
    LOOM_CHECK(group == nullptr ||
                   (group->rank() == topology.rank && group->size() == topology.world_size),
               InvalidArgument, "Runtime::init: attached group '", group->name(), "' is rank ",
               group->rank(), " of ", group->size(), " but the topology is rank ", topology.rank,
               " of ", topology.world_size);
  }
  auto impl = std::make_unique<Impl>();
  impl->store = attachments.store;
  impl->store_attached = attachments.store != nullptr;
  impl->world_group = std::move(attachments.world_group);
  impl->control_group = std::move(attachments.control_group);
  impl->topology = topology;
  impl->config = config;
  impl->run_dir = std::filesystem::absolute(config.get<std::string>("run.dir"));
  util::create_directories(impl->run_dir, "the run directory",
                           "set run.dir to a directory this process can create and write");

  std::optional<std::filesystem::path> log_file;
  if (config.get<bool>("log.to_file")) {
    log_file = impl->run_dir / "logs" / detail::concat("rank_", topology.rank, ".log");
  }
  impl->logger = log::make_logger(topology.rank, topology.world_size,
                                  config.get<std::string>("log.level"), log_file);

  impl->seed = static_cast<uint64_t>(config.get<int64_t>("run.seed"));
  impl->threads = choose_threads(config.get<int>("run.threads"), topology.local_world_size);
  impl->device = choose_device(config.get<std::string>("run.device"), topology.local_rank);
  if (configure_process) {
    if (config.get<bool>("run.keep_freed_memory")) util::keep_freed_memory();
    at::set_num_threads(impl->threads);
    at::manual_seed(impl->seed);
    at::globalContext().setDeterministicAlgorithms(config.get<bool>("run.deterministic"),
                                                   /*warn_only=*/false);
  }
  if (topology.rank == 0) {
    util::write_file_atomic(impl->run_dir / "config.toml", config.to_toml());
  }
  impl->logger->info("loom {}: rank {} of {}, local rank {}, device {}, {} threads, seed {}",
                     version(), topology.rank, topology.world_size, topology.local_rank,
                     impl->device.str(), impl->threads, impl->seed);
  if (topology.generation > 0 && !topology.coordinator.empty()) {
    Impl* raw = impl.get();
    impl->heartbeat = std::make_unique<control::Heartbeat>(control::HeartbeatOptions{
        .address = topology.coordinator,
        .token = topology.job_token,
        .tls = topology.tls,
        .rank = topology.rank,
        .generation = topology.generation,
        .on_flight_dump = [raw] { raw->dump_flight(); },
        .activity =
            [raw] {
              return control::Activity{metrics::current_activity(), raw->collective_in_flight()};
            },
        .log = impl->logger});
  }
  return Runtime(std::move(impl));
}

int Runtime::rank() const { return impl_->topology.rank; }
int Runtime::world_size() const { return impl_->topology.world_size; }
int Runtime::local_rank() const { return impl_->topology.local_rank; }
int Runtime::local_world_size() const { return impl_->topology.local_world_size; }
const std::string& Runtime::coordinator() const { return impl_->topology.coordinator; }
const Topology& Runtime::topology() const { return impl_->topology; }
c10::Device Runtime::device() const { return impl_->device; }
uint64_t Runtime::seed() const { return impl_->seed; }
uint64_t Runtime::rank_seed() const {
  return mix_seed(impl_->seed, static_cast<uint64_t>(impl_->topology.rank));
}
int Runtime::threads() const { return impl_->threads; }
const Config& Runtime::config() const { return impl_->config; }
const std::filesystem::path& Runtime::run_dir() const { return impl_->run_dir; }
spdlog::logger& Runtime::log() const { return *impl_->logger; }

const char* version() { return LOOM_VERSION; }

int run_main(int argc, const char* const* argv, const ConfigSchema& program_keys,
             const std::function<void(Runtime&)>& body) {
  try {
    Runtime runtime = Runtime::init(argc, argv, program_keys);
    body(runtime);
    return 0;
  } catch (const HelpRequested& help) {
    std::cout << help.what() << std::endl;
    return 0;
  } catch (const InvalidArgument& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}

comm::Store& Runtime::store() const {
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> create(impl.create_mutex);
  std::lock_guard<std::mutex> lock(impl.mutex);  // creating a store connects to nothing
  if (impl.store != nullptr) return *impl.store;
  const Topology& t = impl.topology;
  if (t.generation > 0 && !t.coordinator.empty()) {
    impl.base_store = std::make_unique<control::CoordinatorStore>(t.coordinator, t.job_token,
                                                                  std::chrono::seconds(60), t.tls);
    impl.owned_store =
        std::make_unique<comm::PrefixStore>(detail::concat("gen", t.generation), *impl.base_store);
  } else if (!t.store_dir.empty()) {
    impl.owned_store = std::make_unique<comm::FileStore>(t.store_dir);
  } else {
    LOOM_CHECK(t.world_size == 1, InvalidArgument, "rank ", t.rank, " of ", t.world_size,
               " has no rendezvous store: start multi-process jobs with `loom run` (or set "
               "LOOM_STORE_DIR to a directory all ranks share)");
    impl.owned_store = std::make_unique<comm::InMemoryStore>();
  }
  impl.store = impl.owned_store.get();
  return *impl.store;
}

namespace {

// A Gloo group of all ranks; `loom run` tells each worker the address its node reaches the
// other nodes by (Topology::advertise_addr).
std::unique_ptr<comm::Group> new_gloo_world(comm::Store& store, const Topology& t,
                                            const std::string& name,
                                            const std::filesystem::path& flight_dir,
                                            bool shared_memory) {
  return comm::new_gloo_group(
      store, t.rank, t.world_size,
      {.hostname = t.advertise_addr.empty() ? "127.0.0.1" : t.advertise_addr,
       .flight_dump_dir = flight_dir,
       .name = name,
       .shared_memory = shared_memory});
}

}  // namespace

parallel::DeviceMesh& Runtime::mesh() const {
  comm::Group& world = world_group();
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> create(impl.create_mutex);
  {
    std::lock_guard<std::mutex> lock(impl.mutex);
    if (impl.mesh) return *impl.mesh;
  }
  std::unique_ptr<parallel::DeviceMesh> mesh = parallel::mesh_from(world, impl.config);
  std::lock_guard<std::mutex> lock(impl.mutex);
  impl.mesh = std::move(mesh);
  return *impl.mesh;
}

comm::Group& Runtime::world_group() const {
  comm::Store& s = store();
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> create(impl.create_mutex);
  {
    std::lock_guard<std::mutex> lock(impl.mutex);
    if (impl.world_group) return *impl.world_group;
  }
  const Topology& t = impl.topology;
  std::unique_ptr<comm::Group> group;
  if (impl.device.is_cuda()) {
    group = comm::new_nccl_group(
        s, t.rank, t.world_size,
        {.device = impl.device.index(), .flight_dump_dir = impl.flight_dir(false)});
  } else {
    group = new_gloo_world(s, t, "world", impl.flight_dir(false),
                           impl.config.get<bool>("comm.shared_memory"));
    if (t.world_size > 1) {
      impl.logger->info("world group: {} ranks, gloo over {}", t.world_size,
                        comm::gloo_transport(*group));
    }
  }
  std::lock_guard<std::mutex> lock(impl.mutex);
  impl.world_group = std::move(group);
  return *impl.world_group;
}

comm::Group& Runtime::control_group() const {
  comm::Store& s = store();
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> create(impl.create_mutex);
  {
    std::lock_guard<std::mutex> lock(impl.mutex);
    if (impl.control_group) return *impl.control_group;
  }
  // A second Gloo group even on the CPU, where world_group is Gloo too: control scalars then
  // never wait behind gradient buckets queued on the world group's worker, and the CPU runs
  // the same group layout (and the same tests) as a GPU job. It costs one more connection
  // per peer and two threads per rank.
  std::unique_ptr<comm::Group> group =
      new_gloo_world(s, impl.topology, "control", impl.flight_dir(true),
                     impl.config.get<bool>("comm.shared_memory"));
  std::lock_guard<std::mutex> lock(impl.mutex);
  impl.control_group = std::move(group);
  return *impl.control_group;
}

void Runtime::report_progress(int64_t step, double throughput, const std::string& state) const {
  if (impl_->heartbeat) impl_->heartbeat->update(step, throughput, state);
}

void Runtime::report_step(const metrics::StepMetrics& m) const {
  if (!impl_->heartbeat) return;
  control::StepSample sample{.step = m.record.step,
                             .seconds = m.times.total,
                             .tokens = m.record.tokens,
                             .samples = m.record.samples,
                             .mfu = m.mfu.value_or(-1),
                             .rss_bytes = m.memory.rss_bytes,
                             .loss = m.record.loss,
                             .goodput = m.goodput.goodput};
  for (size_t i = 0; i < metrics::kNumPhases; ++i)
    sample.phase_seconds[metrics::to_string(static_cast<metrics::Phase>(i))] = m.times.seconds[i];
  impl_->heartbeat->add_step(sample);
  impl_->heartbeat->update(
      m.record.step,
      m.record.tokens > 0 ? m.tokens_per_second_smoothed : m.samples_per_second_smoothed,
      "training");
}

namespace {

// Under model parallelism (parallel.pp or parallel.tp above 1) the data is sharded over the
// mesh's dp dimension only: the tensor- and pipeline-parallel ranks of one replica read the same
// batches. Otherwise over every rank.
std::pair<int, int> data_shard(const Runtime& rt) {
  const Config& c = rt.config();
  if (c.get<int64_t>("parallel.pp") == 1 && c.get<int64_t>("parallel.tp") == 1)
    return {rt.rank(), rt.world_size()};
  const parallel::DeviceMesh& mesh = rt.mesh();
  return {mesh.coordinate("dp"), mesh.size("dp")};
}

}  // namespace

std::unique_ptr<data::Reader> Runtime::open_dataset(const std::filesystem::path& dir,
                                                    data::ReaderOptions options) const {
  std::tie(options.rank, options.world_size) = data_shard(*this);
  auto reader = std::make_unique<data::Reader>(dir, options);
  // What `loom data show|serve RUN_DIR` read back: the run's datasets and reader options.
  if (rank() == 0) data::record_run_reader(impl_->run_dir, dir.string(), *reader);
  return reader;
}

std::unique_ptr<data::ServiceReader> Runtime::open_data_service(
    const std::string& service, const std::filesystem::path& dataset,
    data::ReaderOptions options) const {
  std::tie(options.rank, options.world_size) = data_shard(*this);
  return std::make_unique<data::ServiceReader>(
      dataset.string(), options,
      data::ServiceReaderOptions{.endpoints = this->service(service),
                                 .resolve = [this, service] { return this->service(service); },
                                 .service = service,
                                 .token = impl_->topology.job_token});
}

std::unique_ptr<data::Mixture> Runtime::open_mixture(std::vector<data::MixtureSource> sources,
                                                     data::MixtureOptions options) const {
  std::tie(options.rank, options.world_size) = data_shard(*this);
  auto mixture = std::make_unique<data::Mixture>(std::move(sources), options);
  if (rank() == 0) data::record_run_mixture(impl_->run_dir, *mixture);
  return mixture;
}

namespace {

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    if (comma > start) out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

std::string join_list(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

std::vector<std::string> Runtime::service(const std::string& name,
                                          std::chrono::milliseconds timeout) const {
  const Topology& t = impl_->topology;
  if (!impl_->store_attached && (t.generation <= 0 || t.coordinator.empty())) {
    const auto it = t.services.find(control::service_env_name(name));
    if (it == t.services.end()) {
      std::vector<std::string> vars;
      for (const auto& [var, value] : t.services) vars.push_back(var);
      throw InvalidArgument(detail::concat(
          "no service named '", name, "': ", control::service_env_name(name),
          " is not set (not under `loom run`; the LOOM_SERVICE_* variables set: ", join_list(vars),
          ")"));
    }
    return split_list(it->second);
  }
  store();  // creates the base store under `loom run`
  comm::Store* base = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    base = impl_->base_store ? impl_->base_store.get() : impl_->store;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto left = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  std::string names;
  try {
    names = base->get(control::kServicesKey, left());
  } catch (const Timeout&) {
    throw Timeout(detail::concat("looking for service '", name,
                                 "': the coordinator's store holds no list of the job's services "
                                 "after ",
                                 timeout.count(), " ms (is this a `loom run` job?)"));
  }
  const std::vector<std::string> services = split_list(names);
  LOOM_CHECK(std::find(services.begin(), services.end(), name) != services.end(), InvalidArgument,
             "no service named '", name, "' in the job; its services: ", join_list(services),
             services.empty() ? " (start it with `loom run --job FILE`)" : "");
  const std::string count_key = control::service_count_key(name);
  int count = 0;
  try {
    count = std::stoi(base->get(count_key, left()));
  } catch (const Timeout&) {
    throw Timeout(detail::concat("service '", name, "' published no replicas within ",
                                 timeout.count(), " ms (", count_key,
                                 " is missing): is its node's `loom run` still starting it?"));
  } catch (const std::logic_error&) {
    throw CorruptData(detail::concat("the coordinator's store holds a malformed ", count_key));
  }
  std::vector<std::string> endpoints;
  for (int replica = 0; replica < count; ++replica) {
    try {
      endpoints.push_back(base->get(control::service_replica_key(name, replica), left()));
    } catch (const Timeout&) {
      std::vector<std::string> missing;
      for (int r = replica; r < count; ++r) {
        if (!base->check({control::service_replica_key(name, r)}))
          missing.push_back(std::to_string(r));
      }
      throw Timeout(detail::concat("service '", name, "': replica(s) ", join_list(missing), " of ",
                                   count, " not ready within ", timeout.count(),
                                   " ms (see <run-dir>/services_node<N>.json and its logs)"));
    }
  }
  return endpoints;
}

}  // namespace loom
