// The Gloo backend: collectives on CPU tensors over TCP, bootstrapped through a Store.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

#include "loom/comm/group.h"
#include "loom/comm/store.h"
#include "loom/visibility.h"

namespace loom::comm {

struct GlooOptions {
  std::string hostname = "127.0.0.1";  // the address this rank listens on and advertises
  std::string interface;               // a network interface to use instead, e.g. "eth0"
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(120)};
  size_t flight_capacity = 2048;          // ops kept by the flight recorder
  std::filesystem::path flight_dump_dir;  // rank_<r>.json is written here on a timeout ("" = no)
  std::string name = "world";             // the group's name in errors and dumps
  // The intra-node fast path: when every rank of the group is on this host (same kernel boot,
  // network and mount namespace), the collectives run through a shared-memory segment instead
  // of loopback TCP; send/recv stay on TCP. When the ranks span hosts and some share one,
  // all_reduce is hierarchical: inside each host through shared memory, between one leader per
  // host (its lowest rank) over TCP, then a broadcast inside each host; the other ops use TCP.
  // false: TCP for everything.
  bool shared_memory = true;
  // Which ranks share a host: ranks with equal values. Empty (the default): detected from the
  // kernel's boot id, the hostname and the network and mount namespaces. Set it where that
  // detection is wrong for the deployment (containers in separate network namespaces that
  // share /dev/shm) or to lay out hosts in tests.
  std::string host;
  // The piece of a tensor one rank moves through shared memory per step; the segment holds
  // size() + 1 of them. 256 KiB keeps a step in the shared cache (measured: 64 KiB to 4 MiB in
  // docs/benchmarks.md).
  size_t shared_memory_slot_bytes = size_t{256} << 10;
};

// Connects `size` ranks (this one is `rank`) in a full mesh (and, on one host, a shared-memory
// segment: see GlooOptions::shared_memory); every rank calls it with the same
// store. Keys live under "gloo/<name>#<n>", n counting this rank's creations of that name, so a
// name may be reused (tests, rebuilding after a failure). Blocks until connected or the connect
// timeout, which is a Timeout naming the ranks that did not arrive. The store must outlive the
// group: new_subgroup bootstraps through it. Destroying the group fails the ops not yet started;
// an op in flight ends first (when its peers close their connections or its timeout passes).
LOOM_API std::unique_ptr<Group> new_gloo_group(Store& store, int rank, int size,
                                               const GlooOptions& options = {});

// "shared memory" when `group` is a Gloo group whose collectives run through shared memory,
// "hierarchical" when its all_reduce runs through shared memory inside each host and TCP
// between hosts, "tcp" for a Gloo group over TCP, "" for any other group.
LOOM_API std::string gloo_transport(const Group& group);

}  // namespace loom::comm
