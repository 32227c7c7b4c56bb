// How the `loom` subcommands that serve a page (`loom dash`, `loom data serve`) listen: on a
// host:port, loopback unless --public with a token in LOOM_JOB_TOKEN (then every request must
// carry it as a bearer token), until SIGINT or SIGTERM.
#pragma once

#include <string>

namespace httplib {
class Server;
}

namespace loom::cli {

// Binds `server` to `address` (host:port, port 0: any free port), prints `banner` followed by
// the URL, and serves until SIGINT or SIGTERM. `what` names the server in errors ("the
// dashboard"). Bad addresses, a public address without --public and a token, and an address
// in use are loom::Error (InvalidArgument or IoError) before anything is served.
void serve_until_stopped(httplib::Server& server, const std::string& address, bool public_flag,
                         const std::string& what, const std::string& banner);

}  // namespace loom::cli
