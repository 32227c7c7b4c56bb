// A service's health check, run from the node it is on: whether a job spec's service (or one
// `loom service start` runs) is ready. Shared by the job's supervisor (services.cpp) and the
// registry of long-lived services (service_registry.cpp). Private to Loom.
#pragma once

#include <string>

#include "loom/control/job_spec.h"

namespace loom::control {

// Whether the check passes now: tcp, 127.0.0.1:port accepts a connection; http, GET path there
// answers 2xx; none or heartbeat, always (readiness is "started"). Each attempt takes at most
// half a second; never throws.
bool healthy(const Health& health);

// "tcp port 7000", "http :8080/healthz answering 2xx", "started".
std::string describe(const Health& health);

}  // namespace loom::control
