// A client of the coordinator: one channel, the job token on every call, a deadline on every
// call, gRPC failures turned into Loom errors. Private to Loom; used by CoordinatorStore, the
// launcher's agents and the workers' heartbeat thread. Thread-safe (gRPC stubs are).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "loom.grpc.pb.h"
#include "loom/control/tls.h"
#include "loom/error.h"

namespace loom::control {

class CoordinatorClient {
 public:
  using Stub = loom::control::v1::Coordinator::Stub;

  // TLS when `tls` is enabled (control/tls.h says what it needs); its files are read here.
  CoordinatorClient(std::string address, std::string token, std::chrono::milliseconds rpc_timeout,
                    const TlsFiles& tls = {});

  const std::string& address() const { return address_; }

  // Calls stub method `method` ("Join") with a deadline of rpc_timeout + extra. Failures:
  // unreachable coordinator -> CommError naming its address, refused token -> CommError
  // saying so, no answer in time -> Timeout naming the call (and, a TLS handshake failing
  // looking the same to gRPC, the TLS files to check).
  template <typename Request, typename Reply>
  Reply call(const char* name,
             grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Reply*),
             const Request& request,
             std::chrono::milliseconds extra = std::chrono::milliseconds(0)) const {
    grpc::ClientContext context;
    prepare(context, extra);
    Reply reply;
    check(name, ((*stub_).*method)(&context, request, &reply), extra);
    return reply;
  }

 private:
  void prepare(grpc::ClientContext& context, std::chrono::milliseconds extra) const;
  void check(const char* name, const grpc::Status& status, std::chrono::milliseconds extra) const;

  // Constant after construction.
  std::string address_;
  std::string token_;
  std::chrono::milliseconds rpc_timeout_;
  bool tls_ = false;
  std::unique_ptr<Stub> stub_;
};

}  // namespace loom::control
