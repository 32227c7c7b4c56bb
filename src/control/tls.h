// gRPC credentials from TlsFiles (loom/control/tls.h): plaintext when TLS is off, SSL
// otherwise. Private to Loom; the coordinator and CoordinatorClient use it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "loom/control/tls.h"

namespace loom::control {

// The coordinator's credentials. TLS without both cert and key is InvalidArgument; with `ca`,
// clients must present a certificate it signed.
std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsFiles& tls);
// A client's credentials. TLS without `ca`, or with only one of cert and key, is
// InvalidArgument.
std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const TlsFiles& tls);

}  // namespace loom::control
