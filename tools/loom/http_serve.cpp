// Listening for `loom dash` and `loom data serve` (http_serve.h).
#include "http_serve.h"

#include <httplib.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "loom/error.h"

namespace loom::cli {
namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_stop_signal(int) { g_stop = 1; }

}  // namespace

void serve_until_stopped(httplib::Server& server, const std::string& address, bool public_flag,
                         const std::string& what, const std::string& banner) {
  const size_t colon = address.rfind(':');
  LOOM_CHECK(colon != std::string::npos && colon > 0, InvalidArgument,
             "--address must be host:port, got '", address, "'");
  std::string host = address.substr(0, colon);
  int port = -1;
  try {
    port = std::stoi(address.substr(colon + 1));
  } catch (const std::exception&) {
  }
  LOOM_CHECK(port >= 0 && port <= 65535, InvalidArgument,
             "--address must be host:port with a port in [0, 65535], got '", address, "'");
  const bool loopback =
      host == "127.0.0.1" || host == "localhost" || host == "::1" || host == "[::1]";
  if (!loopback) {
    const char* token = std::getenv("LOOM_JOB_TOKEN");
    LOOM_CHECK(public_flag && token != nullptr && *token != 0, InvalidArgument, what,
               " would listen on ", address,
               ", beyond loopback: that needs --public and a token in LOOM_JOB_TOKEN, which "
               "the browser then sends as 'Authorization: Bearer <token>'");
    const std::string expected = std::string("Bearer ") + token;
    server.set_pre_routing_handler([expected](const httplib::Request& req, httplib::Response& res) {
      if (req.get_header_value("Authorization") == expected) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      res.status = 401;
      res.set_content("wrong or missing token (Authorization: Bearer <LOOM_JOB_TOKEN>)\n",
                      "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  const int bound =
      port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  LOOM_CHECK(bound > 0, IoError, what, " cannot listen on ", address,
             " (address in use or not local?)");
  // The signals set a flag; a thread of its own stops the server (not the handler).
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  std::thread stopper([&server] {
    while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.stop();
  });
  std::cout << banner << " at http://" << address.substr(0, colon + 1) << bound
            << "/ (Ctrl-C stops it)" << std::endl;
  server.listen_after_bind();
  g_stop = 1;
  stopper.join();
}

}  // namespace loom::cli
