// bench_data --mode=weights (bench_weights.cpp): weight snapshots beside memcpy and raw TCP.
#pragma once

#include <string>

namespace loom::bench {

struct WeightsSettings {
  double mib = 64;  // bytes per version, in 4 MiB float32 tensors
  int rounds = 5;   // per transport: round 0 cold, the median of the others warm
  bool json = false;
  // --mode=weights-peer only: the subscriber's source and the raw baseline's address.
  std::string peer_source;
  std::string peer_raw;
};

// Prints the rows: shm beside memcpy, TCP on loopback and (as root) between two network
// namespaces beside raw TCP.
int run_weights(const WeightsSettings& s);
// The subscriber process run_weights starts.
int run_weights_peer(const WeightsSettings& s);

}  // namespace loom::bench
