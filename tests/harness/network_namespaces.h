// Two network namespaces joined by a veth pair, 10.231.0.1 and 10.231.0.2: each "node" has its
// own address, as on two machines. Needs root and iproute2 (ip netns); ok() is false otherwise
// and the test skips. Removed on destruction.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace loom::testing {

class NetworkNamespaces {
 public:
  NetworkNamespaces() {
    const std::string id = std::to_string(::getpid() % 100000);
    ns_ = {"loom-a-" + id, "loom-b-" + id};
    const std::string va = "lma" + id, vb = "lmb" + id;
    ok_ = sh("ip netns add " + ns_[0]) && sh("ip netns add " + ns_[1]) &&
          sh("ip link add " + va + " type veth peer name " + vb) &&
          sh("ip link set " + va + " netns " + ns_[0]) &&
          sh("ip link set " + vb + " netns " + ns_[1]) &&
          in(0, "ip addr add 10.231.0.1/24 dev " + va) &&
          in(1, "ip addr add 10.231.0.2/24 dev " + vb) && in(0, "ip link set " + va + " up") &&
          in(1, "ip link set " + vb + " up") && in(0, "ip link set lo up") &&
          in(1, "ip link set lo up");
  }
  ~NetworkNamespaces() {
    for (const auto& ns : ns_) sh("ip netns del " + ns);
  }
  NetworkNamespaces(const NetworkNamespaces&) = delete;
  NetworkNamespaces& operator=(const NetworkNamespaces&) = delete;

  bool ok() const { return ok_; }
  const std::string& name(int i) const { return ns_[static_cast<size_t>(i)]; }
  // The address of namespace i's end of the pair.
  static std::string address(int i) { return i == 0 ? "10.231.0.1" : "10.231.0.2"; }
  // argv prefixed to run a program inside namespace i.
  std::vector<std::string> exec_in(int i) const { return {"ip", "netns", "exec", name(i)}; }

 private:
  static bool sh(const std::string& command) {
    return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
  }
  bool in(int i, const std::string& command) {
    return sh("ip netns exec " + name(i) + " " + command);
  }
  std::vector<std::string> ns_;
  bool ok_ = false;
};

}  // namespace loom::testing
