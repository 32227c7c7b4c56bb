// TestCa: `openssl req` and `openssl x509 -req` into the test's directory.
#include "harness/certs.h"

#include <fstream>
#include <stdexcept>

#include "harness/harness.h"

namespace loom::testing {
namespace {

void openssl(const std::vector<std::string>& args, const std::filesystem::path& dir) {
  std::vector<std::string> argv = {"openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  const ProgramResult r = run_program(argv, dir);
  if (r.exit_code != 0) throw std::runtime_error("openssl " + args[0] + " failed:\n" + r.output);
}

// A new EC P-256 key and a request (or, with x509, a self-signed certificate) for `cn`.
std::vector<std::string> new_key(const std::filesystem::path& key, const std::string& cn) {
  return {"-newkey",    "ec",    "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
          key.string(), "-subj", "/CN=" + cn};
}

}  // namespace

bool have_openssl() {
  return run_program({"openssl", "version"}, std::filesystem::temp_directory_path()).exit_code == 0;
}

TestCa::TestCa(const std::filesystem::path& dir, const std::string& name)
    : dir_(dir), cert_(dir / (name + "_ca.pem")), key_(dir / (name + "_ca.key")) {
  std::vector<std::string> args = {"req", "-x509", "-days", "2", "-out", cert_.string()};
  for (const auto& a : new_key(key_, name + " CA")) args.push_back(a);
  args.insert(args.end(), {"-addext", "basicConstraints=critical,CA:TRUE", "-addext",
                           "keyUsage=critical,keyCertSign,cRLSign"});
  openssl(args, dir_);
}

TestCa::Issued TestCa::issue(const std::string& name, const std::vector<std::string>& ips) const {
  const Issued out{dir_ / (name + ".pem"), dir_ / (name + ".key")};
  const auto csr = dir_ / (name + ".csr");
  const auto ext = dir_ / (name + ".ext");
  std::string san = "subjectAltName=";
  for (size_t i = 0; i < ips.size(); ++i) san += (i ? ",IP:" : "IP:") + ips[i];
  std::ofstream(ext) << san << "\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                     << "extendedKeyUsage=serverAuth,clientAuth\n";
  std::vector<std::string> args = {"req", "-out", csr.string()};
  for (const auto& a : new_key(out.key, name)) args.push_back(a);
  openssl(args, dir_);
  openssl({"x509", "-req", "-in", csr.string(), "-CA", cert_.string(), "-CAkey", key_.string(),
           "-CAcreateserial", "-days", "2", "-out", out.cert.string(), "-extfile", ext.string()},
          dir_);
  return out;
}

}  // namespace loom::testing
