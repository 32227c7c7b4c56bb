// comm::Store over the coordinator's gRPC key-value service: how workers started by
// `loom run` rendezvous, on one host or many. Keys of different generations never mix:
// Runtime wraps it in a PrefixStore per generation.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "loom/comm/store.h"
#include "loom/control/tls.h"
#include "loom/visibility.h"

namespace loom::control {

// Thread-safe, like every Store. Each call is one RPC; blocking calls wait on the server side
// up to their timeout. An unreachable coordinator is CommError naming its address; a refused
// token is CommError saying so; a wait past its timeout is Timeout naming the keys. With `tls`
// (see TlsFiles) the channel is TLS, and a coordinator that cannot be verified, or that
// refuses this client's certificate, answers nothing: Timeout, naming TLS among the causes.
class LOOM_API CoordinatorStore final : public comm::Store {
 public:
  CoordinatorStore(const std::string& address, const std::string& token,
                   std::chrono::milliseconds rpc_timeout = std::chrono::seconds(60),
                   const TlsFiles& tls = {});
  ~CoordinatorStore() override;
  using comm::Store::get;
  using comm::Store::wait;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::control
