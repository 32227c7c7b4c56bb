// CoordinatorStore: comm::Store as RPCs to the coordinator's key-value service.
#include "loom/control/store.h"

#include "control/client.h"

namespace loom::control {

using std::chrono::milliseconds;

struct CoordinatorStore::Impl {
  CoordinatorClient client;
};

CoordinatorStore::CoordinatorStore(const std::string& address, const std::string& token,
                                   milliseconds rpc_timeout, const TlsFiles& tls)
    : impl_(std::make_unique<Impl>(Impl{CoordinatorClient(address, token, rpc_timeout, tls)})) {}

CoordinatorStore::~CoordinatorStore() = default;

void CoordinatorStore::set(const std::string& key, const std::string& value) {
  v1::SetRequest req;
  req.set_key(key);
  req.set_value(value);
  impl_->client.call("Set", &CoordinatorClient::Stub::Set, req);
}

std::string CoordinatorStore::get(const std::string& key, milliseconds timeout) {
  v1::GetRequest req;
  req.set_key(key);
  req.set_timeout_ms(timeout.count());
  const auto reply = impl_->client.call("Get", &CoordinatorClient::Stub::Get, req, timeout);
  LOOM_CHECK(reply.found(), Timeout, "coordinator store: key '", key, "' was not set within ",
             timeout.count(), " ms");
  return reply.value();
}

int64_t CoordinatorStore::add(const std::string& key, int64_t delta) {
  v1::AddRequest req;
  req.set_key(key);
  req.set_delta(delta);
  return impl_->client.call("Add", &CoordinatorClient::Stub::Add, req).value();
}

std::string CoordinatorStore::compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired) {
  v1::CompareSetRequest req;
  req.set_key(key);
  req.set_expected(expected);
  req.set_desired(desired);
  return impl_->client.call("CompareSet", &CoordinatorClient::Stub::CompareSet, req).value();
}

void CoordinatorStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  v1::WaitRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(timeout.count());
  const auto reply = impl_->client.call("Wait", &CoordinatorClient::Stub::Wait, req, timeout);
  if (reply.missing().empty()) return;
  std::string missing;
  for (const auto& k : reply.missing()) missing += (missing.empty() ? "" : ", ") + k;
  throw Timeout(
      detail::concat("coordinator store: keys not set within ", timeout.count(), " ms: ", missing));
}

bool CoordinatorStore::check(const std::vector<std::string>& keys) {
  v1::CheckRequest req;
  for (const auto& k : keys) req.add_keys(k);
  return impl_->client.call("Check", &CoordinatorClient::Stub::Check, req).all_present();
}

bool CoordinatorStore::remove(const std::string& key) {
  v1::RemoveRequest req;
  req.set_key(key);
  return impl_->client.call("Remove", &CoordinatorClient::Stub::Remove, req).existed();
}

}  // namespace loom::control
