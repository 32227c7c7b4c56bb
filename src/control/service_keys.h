// Where a job's services are found: the coordinator's store keys the `loom run` agents publish
// them under and the environment variable a worker gets; shared by the supervisor
// (services.cpp) and the client (Runtime::service). Private to Loom.
#pragma once

#include <cctype>
#include <string>

namespace loom::control {

// "data,eval": the names of the job spec's services, comma-separated ("" for none). Every agent
// publishes it once it joins, before any worker starts, so that a client knows at once whether
// a name exists.
inline constexpr const char* kServicesKey = "services";

// "services/<name>/replicas": how many replicas the service has in the whole job.
inline std::string service_count_key(const std::string& name) {
  return "services/" + name + "/replicas";
}

// "services/<name>/<replica>": that replica's "host:port" ("host" without a port), published
// once it is ready and again after each restart.
inline std::string service_replica_key(const std::string& name, int replica) {
  return "services/" + name + "/" + std::to_string(replica);
}

// "services/status/node<N>": node N's services as services_node<N>.json holds them (a JSON
// array), published by its supervisor on every change; the coordinator adds every node's to the
// job's metrics (/api/metrics, `loom top`).
inline std::string service_status_key(int node) {
  return "services/status/node" + std::to_string(node);
}

// LOOM_SERVICE_DATA_CACHE for "data-cache": letters and digits upper-cased, anything else '_'.
inline std::string service_env_name(const std::string& name) {
  std::string out = "LOOM_SERVICE_";
  for (char c : name) {
    out += std::isalnum(static_cast<unsigned char>(c))
               ? static_cast<char>(std::toupper(static_cast<unsigned char>(c)))
               : '_';
  }
  return out;
}

}  // namespace loom::control
