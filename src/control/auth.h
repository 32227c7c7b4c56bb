// The job token on gRPC calls: clients attach it, the coordinator checks it. Private.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

namespace loom::control {

inline constexpr char kTokenMetadata[] = "loom-token";

// Whether the call carries `token` (always true when the job has no token).
inline bool authorized(const grpc::ServerContext& context, const std::string& token) {
  if (token.empty()) return true;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kTokenMetadata);
  return it != metadata.end() && std::string(it->second.data(), it->second.size()) == token;
}

}  // namespace loom::control
