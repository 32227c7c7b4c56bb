// Reading the PEM files of TlsFiles into gRPC's SSL credentials, with errors that name the
// file and the flag it came from.
#include "control/tls.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "loom/error.h"

namespace loom::control {
namespace {

// The file's text. `what` names it for people ("the TLS certificate (--tls-cert)"); `marker`
// is the PEM header it must hold ("CERTIFICATE", "PRIVATE KEY").
std::string read_pem(const std::filesystem::path& path, const char* what, const char* marker) {
  std::error_code ec;
  LOOM_CHECK(!std::filesystem::is_directory(path, ec), IoError, "cannot read ", what, " ", path,
             ": it is a directory");
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.is_open(), IoError, "cannot read ", what, " ", path, ": ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  LOOM_CHECK(!in.bad(), IoError, "cannot read ", what, " ", path, ": ", std::strerror(errno));
  const std::string pem = text.str();
  const std::string begin = "-----BEGIN ";
  bool found = false;
  for (auto at = pem.find(begin); at != std::string::npos && !found; at = pem.find(begin, at + 1)) {
    const auto end = pem.find("-----", at + begin.size());
    found = end != std::string::npos &&
            pem.compare(end - std::strlen(marker), std::strlen(marker), marker) == 0;
  }
  LOOM_CHECK(found, InvalidArgument, what, " ", path, " is not a PEM file with a ", marker,
             " block (-----BEGIN ...", marker, "-----)");
  return pem;
}

constexpr char kCert[] = "the TLS certificate (--tls-cert)";
constexpr char kKey[] = "the TLS private key (--tls-key)";
constexpr char kCa[] = "the TLS CA certificate (--tls-ca)";

}  // namespace

std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  LOOM_CHECK(!tls.cert.empty() && !tls.key.empty(), InvalidArgument,
             "a coordinator with TLS needs its certificate and private key (--tls-cert and "
             "--tls-key)");
  grpc::SslServerCredentialsOptions options(
      tls.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                     : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  // Read in the flags' order, so that the first bad one is the one named.
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  pair.cert_chain = read_pem(tls.cert, kCert, "CERTIFICATE");
  pair.private_key = read_pem(tls.key, kKey, "PRIVATE KEY");
  options.pem_key_cert_pairs.push_back(pair);
  if (!tls.ca.empty()) options.pem_root_certs = read_pem(tls.ca, kCa, "CERTIFICATE");
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  LOOM_CHECK(!tls.ca.empty(), InvalidArgument,
             "a client with TLS needs the CA certificate that verifies the coordinator "
             "(--tls-ca)");
  LOOM_CHECK(tls.cert.empty() == tls.key.empty(), InvalidArgument,
             "a client certificate needs its private key and the key its certificate: give "
             "both --tls-cert and --tls-key, or neither");
  grpc::SslCredentialsOptions options;
  if (!tls.cert.empty()) {
    options.pem_cert_chain = read_pem(tls.cert, kCert, "CERTIFICATE");
    options.pem_private_key = read_pem(tls.key, kKey, "PRIVATE KEY");
  }
  options.pem_root_certs = read_pem(tls.ca, kCa, "CERTIFICATE");
  return grpc::SslCredentials(options);
}

}  // namespace loom::control
