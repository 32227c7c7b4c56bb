#include "control/client.h"

#include "control/auth.h"
#include "control/tls.h"

namespace loom::control {

CoordinatorClient::CoordinatorClient(std::string address, std::string token,
                                     std::chrono::milliseconds rpc_timeout, const TlsFiles& tls)
    : address_(std::move(address)),
      token_(std::move(token)),
      rpc_timeout_(rpc_timeout),
      tls_(tls.enabled()),
      stub_(v1::Coordinator::NewStub(grpc::CreateChannel(address_, channel_credentials(tls)))) {
  LOOM_CHECK(address_.find(':') != std::string::npos, InvalidArgument, "coordinator address '",
             address_, "' is not host:port");
}

void CoordinatorClient::prepare(grpc::ClientContext& context,
                                std::chrono::milliseconds extra) const {
  if (!token_.empty()) context.AddMetadata(kTokenMetadata, token_);
  context.set_deadline(std::chrono::system_clock::now() + rpc_timeout_ + extra);
  context.set_wait_for_ready(true);  // ride out a coordinator that is still starting
}

void CoordinatorClient::check(const char* name, const grpc::Status& status,
                              std::chrono::milliseconds extra) const {
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
      return;
    case grpc::StatusCode::UNAUTHENTICATED:
      throw CommError(detail::concat("the coordinator at ", address_, " refused the job token on ",
                                     name, ": check LOOM_JOB_TOKEN (", status.error_message(),
                                     ")"));
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      throw Timeout(detail::concat("the coordinator at ", address_, " did not answer ", name,
                                   " within ", (rpc_timeout_ + extra).count(),
                                   " ms: is it running and reachable?",
                                   tls_ ? " With TLS, also check that its certificate is signed "
                                          "by --tls-ca and names this address, and that it "
                                          "accepts this node's certificate"
                                        : " If it uses TLS, this client needs --tls-ca too"));
    case grpc::StatusCode::INVALID_ARGUMENT:
      throw InvalidArgument(
          detail::concat("coordinator ", address_, ": ", name, ": ", status.error_message()));
    default:
      throw CommError(detail::concat("coordinator ", address_, ": ", name,
                                     " failed: ", status.error_message(), " (gRPC code ",
                                     static_cast<int>(status.error_code()), ")"));
  }
}

}  // namespace loom::control
