// Built with LOOM_WITH_GRPC=OFF: the control plane's entry points say so.
#include "control/heartbeat.h"
#include "loom/control/coordinator.h"
#include "loom/control/store.h"
#include "loom/data/service.h"
#include "loom/error.h"

namespace loom::control {
namespace {
[[noreturn]] void unavailable() {
  throw InvalidArgument(
      "this Loom was built without the gRPC control plane (LOOM_WITH_GRPC=OFF); "
      "rebuild with -DLOOM_WITH_GRPC=ON to use loom run, the coordinator and the data service");
}
}  // namespace

struct Coordinator::Impl {};
Coordinator::Coordinator(CoordinatorOptions) { unavailable(); }
Coordinator::~Coordinator() = default;
const std::string& Coordinator::address() const { unavailable(); }
const std::string& Coordinator::metrics_address() const { unavailable(); }
std::string Coordinator::job_metrics_json() const { unavailable(); }
bool Coordinator::done() const { unavailable(); }
std::string generate_token() { unavailable(); }

struct CoordinatorStore::Impl {};
CoordinatorStore::CoordinatorStore(const std::string&, const std::string&,
                                   std::chrono::milliseconds, const TlsFiles&) {
  unavailable();
}
CoordinatorStore::~CoordinatorStore() = default;
void CoordinatorStore::set(const std::string&, const std::string&) { unavailable(); }
std::string CoordinatorStore::get(const std::string&, std::chrono::milliseconds) { unavailable(); }
int64_t CoordinatorStore::add(const std::string&, int64_t) { unavailable(); }
std::string CoordinatorStore::compare_set(const std::string&, const std::string&,
                                          const std::string&) {
  unavailable();
}
void CoordinatorStore::wait(const std::vector<std::string>&, std::chrono::milliseconds) {
  unavailable();
}
bool CoordinatorStore::check(const std::vector<std::string>&) { unavailable(); }
bool CoordinatorStore::remove(const std::string&) { unavailable(); }

struct Heartbeat::Impl {};
Heartbeat::Heartbeat(HeartbeatOptions) { unavailable(); }
Heartbeat::~Heartbeat() = default;
void Heartbeat::update(int64_t, double, const std::string&) {}
void Heartbeat::add_step(const StepSample&) {}

}  // namespace loom::control

namespace loom::data {

struct DataServer::Impl {};
DataServer::DataServer(DataServerOptions) { control::unavailable(); }
DataServer::~DataServer() = default;
const std::string& DataServer::address() const { control::unavailable(); }
DataServerStats DataServer::stats() const { control::unavailable(); }
void DataServer::shutdown() {}

struct ServiceReader::Impl {};
ServiceReader::ServiceReader(std::string, ReaderOptions, ServiceReaderOptions) {
  control::unavailable();
}
ServiceReader::~ServiceReader() = default;
Batch ServiceReader::next() { control::unavailable(); }
int64_t ServiceReader::batch_size() const { control::unavailable(); }
std::string ServiceReader::state_json() const { control::unavailable(); }
void ServiceReader::restore_json(const std::string&) { control::unavailable(); }
const ReaderOptions& ServiceReader::options() const { control::unavailable(); }
ServiceReaderStats ServiceReader::stats() const { control::unavailable(); }

}  // namespace loom::data
