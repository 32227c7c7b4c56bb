// The data service and its client (loom/data/service.h).
#include "loom/data/service.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "control/auth.h"
#include "data/reader_options_json.h"
#include "loom.grpc.pb.h"
#include "loom/error.h"
#include "util/deadline.h"
#include "util/dtype.h"
#include "util/hash.h"

namespace loom::data {
namespace {

namespace v1 = loom::control::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The reply's checksum: xxHash64 over the xxHash64s of the tensors' bytes, in order.
uint64_t reply_checksum(const v1::BatchReply& reply) {
  std::vector<uint64_t> hashes;
  hashes.reserve(reply.tensors_size());
  for (const v1::WireTensor& t : reply.tensors()) hashes.push_back(util::xxh64(t.data()));
  return util::xxh64(hashes.data(), hashes.size() * sizeof(uint64_t));
}

void encode(const Batch& batch, const std::string& state, v1::BatchReply& reply) {
  for (const auto& [name, tensor] : batch.tensors) {
    const at::Tensor t = tensor.contiguous();
    v1::WireTensor& w = *reply.add_tensors();
    w.set_name(name);
    w.set_dtype(util::dtype_name(t.scalar_type()));
    for (const int64_t d : t.sizes()) w.add_shape(d);
    w.set_data(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  for (const auto& [name, values] : batch.strings) {
    v1::WireStrings& w = (*reply.mutable_strings())[name];
    for (const std::string& v : values) w.add_values(v);
  }
  for (const uint64_t i : batch.indices) reply.add_indices(i);
  reply.set_num_real(batch.num_real);
  reply.set_epoch(batch.epoch);
  reply.set_state_json(state);
  reply.set_checksum(reply_checksum(reply));
}

Batch decode(const v1::BatchReply& reply, const std::string& replica) {
  LOOM_CHECK(reply_checksum(reply) == reply.checksum(), CorruptData, "a batch from data service ",
             "replica ", replica, " does not match its checksum: its bytes changed on the way");
  Batch batch;
  for (const v1::WireTensor& w : reply.tensors()) {
    const auto dtype = util::dtype_of(w.dtype());
    LOOM_CHECK(dtype.has_value(), CorruptData, "data service replica ", replica, " sent tensor ",
               w.name(), " of unknown dtype '", w.dtype(), "'");
    at::Tensor t = at::empty(std::vector<int64_t>(w.shape().begin(), w.shape().end()),
                             at::TensorOptions().dtype(*dtype));
    LOOM_CHECK(t.nbytes() == w.data().size(), CorruptData, "data service replica ", replica,
               " sent tensor ", w.name(), " with ", w.data().size(), " bytes for its shape's ",
               t.nbytes());
    if (t.nbytes() > 0) std::memcpy(t.data_ptr(), w.data().data(), t.nbytes());
    batch.tensors.emplace(w.name(), std::move(t));
  }
  for (const auto& [name, values] : reply.strings()) {
    batch.strings.emplace(name,
                          std::vector<std::string>(values.values().begin(), values.values().end()));
  }
  batch.indices.assign(reply.indices().begin(), reply.indices().end());
  batch.num_real = reply.num_real();
  batch.epoch = reply.epoch();
  return batch;
}

// The position `skip` batches after `after`, as the reader's sampler would move: each batch
// advances the position by the global batch, and an exhausted epoch starts the next
// (GlobalSampler::next_batch). Nothing is read.
std::string advance(const Reader& reader, const std::string& after, uint32_t skip) {
  if (skip == 0) return after;
  SamplerState state = SamplerState::from_json(after);
  const ReaderOptions& o = reader.options();
  const uint64_t n = reader.num_samples();
  const uint64_t global = static_cast<uint64_t>(o.batch_size) * static_cast<uint64_t>(o.world_size);
  for (uint32_t i = 0; i < skip; ++i) {
    state.position += global;
    if (state.position >= n ||
        (o.epoch_end == EpochEnd::kDropLast && n - state.position < global)) {
      ++state.epoch;
      state.position = 0;
    }
  }
  return state.to_json();
}

// A Loom error as a status the client turns back into the same kind.
grpc::Status to_status(const std::exception& e) {
  const std::string what = e.what();
  if (dynamic_cast<const InvalidArgument*>(&e)) return {grpc::INVALID_ARGUMENT, what};
  if (dynamic_cast<const CorruptData*>(&e)) return {grpc::DATA_LOSS, what};
  if (dynamic_cast<const IoError*>(&e)) return {grpc::FAILED_PRECONDITION, what};
  return {grpc::INTERNAL, what};
}

}  // namespace

// ---- the server ----

struct DataServer::Impl final : v1::DataService::Service {
  // Readers of one (dataset, options): several, so that requests for different batches (a
  // trainer's prefetch window) are read at once; each positioned after the batch it last read.
  struct Slot {
    std::unique_ptr<Reader> reader;
    std::string position;
    bool busy = false;
  };
  struct Pool {
    std::string start;  // the position at the dataset's start
    std::vector<std::unique_ptr<Slot>> slots;
    bool idle() const {
      return std::none_of(slots.begin(), slots.end(), [](const auto& s) { return s->busy; });
    }
  };

  DataServerOptions options;
  std::string address;
  std::unique_ptr<grpc::Server> server;
  std::once_flag shutdown_once;

  mutable std::mutex mutex;  // guards pools, lru and stats
  std::condition_variable freed;
  std::map<std::string, Pool> pools;
  std::list<std::string> lru;  // most recently used first
  DataServerStats stats;

  explicit Impl(DataServerOptions o) : options(std::move(o)) {
    LOOM_CHECK(options.max_readers >= 1 && options.readers_per_client >= 1, InvalidArgument,
               "DataServerOptions::max_readers and readers_per_client must be at least 1, got ",
               options.max_readers, " and ", options.readers_per_client);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    builder.SetMaxSendMessageSize(-1);
    builder.SetMaxReceiveMessageSize(-1);
    server = builder.BuildAndStart();
    LOOM_CHECK(server != nullptr && port != 0, IoError, "the data service cannot listen on ",
               options.address, " (address in use or not local?)");
    address = options.address.substr(0, options.address.rfind(':') + 1) + std::to_string(port);
  }

  // A free Reader of `key`, preferably one already at `after` (empty: the start), marked busy;
  // a new one when none is free and the pool has room; otherwise waits for one.
  Slot& acquire(const std::string& key, const std::string& dataset,
                const ReaderOptions& reader_options, const std::string& after) {
    std::unique_lock<std::mutex> lock(mutex);
    lru.remove(key);
    lru.push_front(key);
    for (;;) {
      Pool& pool = pools[key];
      const std::string& want = after.empty() ? pool.start : after;
      Slot* pick = nullptr;
      for (auto& slot : pool.slots) {
        if (slot->busy || !slot->reader) continue;
        if (pick == nullptr || slot->position == want) pick = slot.get();
      }
      if (pick == nullptr && pool.slots.size() < static_cast<size_t>(options.readers_per_client)) {
        pool.slots.push_back(std::make_unique<Slot>());
        pick = pool.slots.back().get();
        pick->busy = true;
        lock.unlock();
        try {
          pick->reader = std::make_unique<Reader>(dataset, reader_options);
          pick->position = pick->reader->state_json();
        } catch (...) {
          lock.lock();
          auto& slots = pools[key].slots;
          slots.erase(std::find_if(slots.begin(), slots.end(),
                                   [&](const auto& s) { return s.get() == pick; }));
          freed.notify_all();
          throw;
        }
        lock.lock();
        Pool& now = pools[key];
        if (now.start.empty()) now.start = pick->position;
        ++stats.readers;
        evict();
        return *pick;
      }
      if (pick != nullptr) {
        pick->busy = true;
        return *pick;
      }
      freed.wait(lock);
    }
  }

  void release(Slot& slot) {
    std::lock_guard<std::mutex> lock(mutex);
    slot.busy = false;
    freed.notify_all();
  }

  // Closes the least recently used pools beyond max_readers, those in use excepted.
  void evict() {
    size_t open = 0;
    for (const auto& [key, pool] : pools) open += pool.slots.size();
    for (auto it = lru.rbegin();
         it != lru.rend() && open > static_cast<size_t>(options.max_readers);) {
      auto pool = pools.find(*it);
      if (pool == pools.end() || !pool->second.idle()) {
        ++it;
        continue;
      }
      open -= pool->second.slots.size();
      pools.erase(pool);
      it = std::make_reverse_iterator(lru.erase(std::next(it).base()));
    }
  }

  grpc::Status NextBatch(grpc::ServerContext* context, const v1::BatchRequest* request,
                         v1::BatchReply* reply) override {
    if (!control::authorized(*context, options.token)) {
      return {grpc::UNAUTHENTICATED, "wrong or missing job token (loom-token)"};
    }
    try {
      ReaderOptions reader_options;
      try {
        reader_options = reader_options_from_json(nlohmann::json::parse(request->options_json()));
      } catch (const nlohmann::json::exception& e) {
        throw InvalidArgument(detail::concat("malformed reader options: ", e.what()));
      }
      LOOM_CHECK(request->skip() <= 64, InvalidArgument,
                 "a request may skip at most 64 batches, not ", request->skip());
      reader_options.prefetch = 0;  // the clients' requests are the prefetch
      const std::string key =
          request->dataset() + "\n" + reader_options_json(reader_options).dump();
      Slot& slot = acquire(key, request->dataset(), reader_options, request->state_json());
      struct Release {
        Impl* impl;
        Slot* slot;
        ~Release() { impl->release(*slot); }
      } release{this, &slot};
      std::string start;
      {
        std::lock_guard<std::mutex> lock(mutex);
        start = pools[key].start;
      }
      if (request->position_only()) {
        reply->set_state_json(start);
        return grpc::Status::OK;
      }
      const std::string after =
          advance(*slot.reader, request->state_json().empty() ? start : request->state_json(),
                  request->skip());
      bool restored = false;
      if (after != slot.position) {
        slot.position.clear();  // unknown until restore_json returns
        slot.reader->restore_json(after);
        restored = true;
      }
      const Batch batch = slot.reader->next();
      slot.position = slot.reader->state_json();
      encode(batch, slot.position, *reply);
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.batches;
      stats.restores += restored ? 1 : 0;
      for (const v1::WireTensor& t : reply->tensors()) stats.bytes += t.data().size();
      return grpc::Status::OK;
    } catch (const std::exception& e) {
      return to_status(e);
    }
  }

  void shutdown() {
    std::call_once(shutdown_once, [this] {
      server->Shutdown(std::chrono::system_clock::now() + milliseconds(2000));
    });
  }
};

DataServer::DataServer(DataServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
DataServer::~DataServer() { impl_->shutdown(); }
const std::string& DataServer::address() const { return impl_->address; }
DataServerStats DataServer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}
void DataServer::shutdown() { impl_->shutdown(); }

// ---- the client ----

struct ServiceReader::Impl {
  struct Fetched {
    Batch batch;
    std::string state;  // after the batch
    std::string replica;
    int64_t failovers = 0;
  };
  // A request in flight: the batch `skip` batches after position `after`.
  struct Pending {
    std::string after;
    uint32_t skip = 0;
    std::future<Fetched> result;
  };

  std::string dataset;
  ReaderOptions options;
  std::string options_json;
  ServiceReaderOptions service;
  std::mutex mutex;  // guards service.endpoints, channels, next_replica, cancelled, inflight
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels;
  size_t next_replica = 0;  // where the next request starts
  bool cancelled = false;
  std::vector<grpc::ClientContext*> inflight;
  // Replicas that failed recently: skipped (while another is up) until then.
  std::map<std::string, Clock::time_point> down_until;
  std::string position;         // after the last batch next() returned
  std::deque<Pending> pending;  // the next batches, in order
  ServiceReaderStats stats;

  std::shared_ptr<grpc::Channel> channel(const std::string& endpoint) {
    auto& c = channels[endpoint];
    if (!c) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      args.SetMaxSendMessageSize(-1);
      // A replica restarted at the same address is reached again at once, not after gRPC's
      // default reconnect backoff (up to 2 minutes).
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      c = grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(), args);
    }
    return c;
  }

  // The batch `skip` batches after `after` (or, position_only, the start's position), from the
  // replica whose turn it is or, when it fails, the next ones, until service.deadline.
  Fetched fetch(const std::string& after, uint32_t skip, bool position_only) {
    v1::BatchRequest request;
    request.set_dataset(dataset);
    request.set_options_json(options_json);
    request.set_state_json(after);
    request.set_skip(skip);
    request.set_position_only(position_only);
    const auto deadline = Clock::now() + service.deadline;
    std::map<std::string, std::string> failures;  // endpoint -> its last failure
    Fetched out;
    size_t replica = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      replica = next_replica++;
    }
    size_t failed_in_sweep = 0;
    for (;;) {
      grpc::ClientContext context;
      if (!service.token.empty()) context.AddMetadata(control::kTokenMetadata, service.token);
      context.set_deadline(std::chrono::system_clock::now() +
                           std::min(service.request_timeout,
                                    std::max(util::time_left(deadline), milliseconds(100))));
      std::string endpoint;
      std::shared_ptr<grpc::Channel> chan;
      size_t replicas = 0;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (cancelled) throw CommError("data service request cancelled");
        replicas = service.endpoints.size();
        LOOM_CHECK(replicas > 0, CommError, "data service '", service.service,
                   "' has no replicas to ask (no endpoints)");
        // Past the replicas that failed in the last second, unless every one did.
        for (size_t k = 0; k < replicas; ++k) {
          const auto down = down_until.find(service.endpoints[(replica + k) % replicas]);
          if (down == down_until.end() || Clock::now() >= down->second) {
            replica += k;
            break;
          }
        }
        endpoint = service.endpoints[replica % replicas];
        chan = channel(endpoint);
        inflight.push_back(&context);
      }
      v1::BatchReply reply;
      const grpc::Status status =
          v1::DataService::NewStub(chan)->NextBatch(&context, request, &reply);
      {
        std::lock_guard<std::mutex> lock(mutex);
        inflight.erase(std::find(inflight.begin(), inflight.end(), &context));
      }
      const std::string where =
          detail::concat("data service '", service.service, "' replica ", endpoint);
      switch (status.error_code()) {
        case grpc::OK:
          if (!failures.empty()) {
            std::string list;
            for (const auto& [e, why] : failures) list += detail::concat(e, ": ", why, "; ");
            spdlog::warn("data service '{}': {}read from replica {} instead", service.service, list,
                         endpoint);
          }
          out.state = reply.state_json();
          if (!position_only) out.batch = decode(reply, endpoint);
          out.replica = endpoint;
          return out;
        case grpc::INVALID_ARGUMENT:
          throw InvalidArgument(detail::concat(where, ": ", status.error_message()));
        case grpc::DATA_LOSS:
          throw CorruptData(detail::concat(where, ": ", status.error_message()));
        case grpc::FAILED_PRECONDITION:
          throw IoError(detail::concat(where, ": ", status.error_message()));
        case grpc::UNAUTHENTICATED:
          throw CommError(detail::concat(where, " refused the job token: check LOOM_JOB_TOKEN (",
                                         status.error_message(), ")"));
        case grpc::INTERNAL:
          throw Error(detail::concat(where, ": ", status.error_message()));
        default:  // unreachable, gone, hung, shutting down: ask the next replica
          break;
      }
      failures[endpoint] = detail::concat(status.error_message(), " (gRPC code ",
                                          static_cast<int>(status.error_code()), ")");
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (cancelled) throw CommError("data service request cancelled");
        down_until[endpoint] = Clock::now() + std::chrono::seconds(1);
      }
      ++replica;
      ++out.failovers;
      if (++failed_in_sweep < replicas) continue;
      failed_in_sweep = 0;
      if (util::expired(deadline)) {
        std::string list;
        for (const auto& [e, why] : failures) list += detail::concat("; ", e, ": ", why);
        throw CommError(
            detail::concat("data service '", service.service, "': no replica answered within ",
                           service.deadline.count(), " ms", list,
                           ". Is the service running? Under `loom run`, its output is in "
                           "<run-dir>/logs/",
                           service.service, "_<replica>.out"));
      }
      std::this_thread::sleep_for(std::min(milliseconds(200), util::time_left(deadline)));
      if (service.resolve) {
        std::vector<std::string> fresh;
        try {
          fresh = service.resolve();
        } catch (const Error&) {  // keep the endpoints known; the deadline bounds the wait
        }
        std::lock_guard<std::mutex> lock(mutex);
        if (!fresh.empty()) service.endpoints = std::move(fresh);
      }
    }
  }

  // Requests the batches after the position, up to the prefetch window.
  void fill() {
    const size_t window = static_cast<size_t>(std::max(service.prefetch, 0));
    while (pending.size() < window) {
      const uint32_t skip = static_cast<uint32_t>(pending.size());
      Pending p{position, skip, {}};
      p.result = std::async(std::launch::async,
                            [this, after = position, skip] { return fetch(after, skip, false); });
      pending.push_back(std::move(p));
    }
  }

  // Cancels the requests in flight and waits for their threads.
  void drop_pending() {
    if (pending.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mutex);
      cancelled = true;
      for (grpc::ClientContext* c : inflight) c->TryCancel();
    }
    for (Pending& p : pending) {
      try {
        p.result.get();
      } catch (const std::exception&) {  // cancelled, or failed: either way not wanted
      }
    }
    pending.clear();
    std::lock_guard<std::mutex> lock(mutex);
    cancelled = false;
  }
};

ServiceReader::ServiceReader(std::string dataset, ReaderOptions options,
                             ServiceReaderOptions service)
    : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.dataset = std::move(dataset);
  impl.options = options;
  impl.options_json = reader_options_json(options).dump();
  impl.service = std::move(service);
  LOOM_CHECK(!impl.service.endpoints.empty() || impl.service.resolve, InvalidArgument,
             "data service '", impl.service.service, "': no endpoints to reach it by");
  LOOM_CHECK(impl.service.prefetch >= 0 && impl.service.prefetch <= 64, InvalidArgument,
             "ServiceReaderOptions::prefetch must be in [0, 64], got ", impl.service.prefetch);
  if (impl.service.endpoints.empty()) impl.service.endpoints = impl.service.resolve();
  impl.next_replica = static_cast<size_t>(std::max(options.rank, 0));
  // The start's position: also checks, before the first step, that the service can open the
  // dataset with these options.
  impl.position = impl.fetch("", 0, true).state;
  impl.fill();
}

ServiceReader::~ServiceReader() { impl_->drop_pending(); }

Batch ServiceReader::next() {
  Impl& impl = *impl_;
  const auto started = Clock::now();
  Impl::Fetched fetched;
  if (!impl.pending.empty()) {
    Impl::Pending p = std::move(impl.pending.front());
    impl.pending.pop_front();
    try {
      fetched = p.result.get();
    } catch (...) {
      impl.drop_pending();  // the ones after it are asked again by the next next()
      throw;                // the position stays
    }
  } else {
    fetched = impl.fetch(impl.position, 0, false);
  }
  // The requests still pending were made from older positions with larger skips: they are the
  // batches right after this one. fill() tops the window up from here.
  impl.position = fetched.state;
  impl.stats.wait_seconds += std::chrono::duration<double>(Clock::now() - started).count();
  ++impl.stats.batches;
  impl.stats.failovers += fetched.failovers;
  impl.stats.replica = fetched.replica;
  impl.fill();
  return std::move(fetched.batch);
}

int64_t ServiceReader::batch_size() const { return impl_->options.batch_size; }
std::string ServiceReader::state_json() const { return impl_->position; }

void ServiceReader::restore_json(const std::string& json) {
  impl_->drop_pending();
  SamplerState::from_json(json);  // malformed: CorruptData here, not from a replica
  impl_->position = json;
  impl_->fill();
}

const ReaderOptions& ServiceReader::options() const { return impl_->options; }
ServiceReaderStats ServiceReader::stats() const { return impl_->stats; }

}  // namespace loom::data
