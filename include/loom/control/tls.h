// TLS for the control plane: the PEM files the coordinator and its clients load
// (docs/launcher.md, "Security").
#pragma once

#include <filesystem>

namespace loom::control {

// Paths to PEM files; all empty is plaintext (the default). Files are read when the server or
// the client is built: a missing or unreadable file is IoError naming it, a file that is not
// PEM is InvalidArgument naming it.
//
// For the coordinator (CoordinatorOptions::tls): `cert` and `key` are its certificate (chain,
// leaf first) and private key, both required; when `ca` is given, every client must present a
// certificate signed by it (mutual TLS), else clients are not asked for one.
// For a client (CoordinatorStore, the agents, the workers' heartbeat): `ca` verifies the
// coordinator's certificate, which must also name the address dialled (a SAN entry such as
// IP:10.0.0.1), and is required; `cert` and `key`, both or neither, are presented to a
// coordinator that asks for a client certificate.
struct TlsFiles {
  std::filesystem::path cert;
  std::filesystem::path key;
  std::filesystem::path ca;

  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

}  // namespace loom::control
