// Test certificates made with the `openssl` command: a CA and certificates it signs, with IP
// SANs, for the control plane's TLS tests. Nothing is downloaded or kept: files live in the
// test's directory.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace loom::testing {

// Whether `openssl` runs (tools/install-deps.sh installs it).
bool have_openssl();

// A certificate authority: <dir>/<name>_ca.pem and <name>_ca.key (EC P-256, 2 days).
// Throws std::runtime_error with openssl's output when a command fails.
class TestCa {
 public:
  TestCa(const std::filesystem::path& dir, const std::string& name);
  const std::filesystem::path& cert() const { return cert_; }

  struct Issued {
    std::filesystem::path cert;  // PEM certificate signed by this CA
    std::filesystem::path key;   // its PEM private key
  };
  // A certificate for `name` (CN) valid for TLS servers and clients at the given IPs (SANs).
  Issued issue(const std::string& name, const std::vector<std::string>& ips) const;

 private:
  std::filesystem::path dir_;
  std::filesystem::path cert_;
  std::filesystem::path key_;
};

}  // namespace loom::testing
