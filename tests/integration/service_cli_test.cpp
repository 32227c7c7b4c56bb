// `loom service start|ls|logs|stop` as a user runs it, with real daemonized processes: a
// service started, listed (table and JSON), its log read (whole, tail, followed), stopped; and
// every error: a name running already, an unknown name, a dead record, a program that exits
// before it is ready or is not ready in time, a program not found, a bad name.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "control/service_registry.h"
#include "harness/harness.h"
#include "harness/servers.h"
#include "util/files.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::free_port;
using testing::run_loom;

// Kills whatever the registry in `dir` still runs when a test ends, passed or failed.
struct KillServicesAtExit {
  fs::path dir;
  ~KillServicesAtExit() {
    if (!fs::exists(dir)) return;
    for (const control::ServiceRecord& r : control::ServiceRegistry(dir).list()) {
      if (control::ServiceRegistry::alive(r)) ::kill(-r.pid, SIGKILL);
    }
  }
};

// Whether `text` matches `pattern` as a whole.
bool matches(const std::string& text, const std::string& pattern) {
  return std::regex_match(text, std::regex(pattern));
}

// The regex of a literal string.
std::string quote(const std::string& text) {
  static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
  return std::regex_replace(text, special, R"(\$&)");
}

TEST(ServiceCli, StartListLogsAndStop) {
  testing::TempDir dir;
  const std::string services = (dir / "services").string();
  KillServicesAtExit cleanup{services};
  const int port = free_port();
  const std::string p = std::to_string(port);
  auto run = run_loom(
      dir, {"service", "start", "web", "--dir", services, "--port", p, "--", "python3", "-m",
            "http.server", "{port}", "--bind", "127.0.0.1", "--directory", dir.path().string()});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::string log = services + "/web.log";
  EXPECT_TRUE(matches(run.output, "started web: pid [0-9]+, 127\\.0\\.0\\.1:" + p +
                                      ", ready \\(tcp port " + p + "\\); log " + quote(log) + "\n"))
      << run.output;
  const std::optional<control::ServiceRecord> web = control::ServiceRegistry(services).find("web");
  ASSERT_TRUE(web.has_value());
  EXPECT_TRUE(control::ServiceRegistry::alive(*web));
  EXPECT_NE(::getsid(web->pid), ::getsid(0)) << "a session of its own";
  EXPECT_EQ(::getpgid(web->pid), web->pid) << "a process group of its own";

  // Already running: an error naming its pid and what to do.
  run = run_loom(dir, {"service", "start", "web", "--dir", services, "--port", p, "--", "true"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(matches(run.output, "error: service web is already running \\(pid " +
                                      std::to_string(web->pid) +
                                      ", since [-0-9]+ [:0-9]+\\); `loom service stop web` "
                                      "first, or pick another name\n"))
      << run.output;

  // A service without a port that prints three lines, then one that exits (dead).
  run = run_loom(dir, {"service", "start", "lines", "--dir", services, "--", "sh", "-c",
                       "echo one; echo two; echo three; exec sleep 60"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(matches(run.output, "started lines: pid [0-9]+, ready \\(started\\); log " +
                                      quote(services + "/lines.log") + "\n"))
      << run.output;
  run = run_loom(dir, {"service", "start", "brief", "--dir", services, "--", "sh", "-c",
                       "echo a; sleep 1; echo b"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // Followed until it exits: everything it wrote.
  run = run_loom(dir, {"service", "logs", "brief", "-f", "--dir", services});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_TRUE(matches(run.output, "---- start [-0-9]+ [:0-9]+ ----\na\nb\n")) << run.output;
  for (int i = 0; i < 100 && !testing::contains(util::read_file(services + "/lines.log"), "three");
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  run = run_loom(dir, {"service", "logs", "lines", "--tail", "2", "--dir", services});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_EQ(run.output, "two\nthree\n");
  run = run_loom(dir, {"service", "logs", "lines", "--dir", services});
  EXPECT_TRUE(matches(run.output, "---- start [-0-9]+ [:0-9]+ ----\none\ntwo\nthree\n"))
      << run.output;

  // The table: alive ones with their uptime, the dead one without.
  run = run_loom(dir, {"service", "ls", "--dir", services});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_TRUE(matches(
      run.output,
      "NAME +PID +STATE +ENDPOINT +UPTIME +COMMAND\n"
      "brief +[0-9]+ +dead +- +- +sh -c echo a; sleep 1; echo b\n"
      "lines +[0-9]+ +alive +- +[0-9]+s +sh -c echo one; echo two; echo three; exec sleep 60\n"
      "web +" +
          std::to_string(web->pid) + " +alive +127\\.0\\.0\\.1:" + p +
          " +[0-9]+s +python3 -m http\\.server " + p + " --bind 127\\.0\\.0\\.1 --directory " +
          quote(dir.path().string()) + "\n"))
      << run.output;
  run = run_loom(dir, {"service", "ls", "--json", "--dir", services});
  EXPECT_EQ(run.exit_code, 0);
  const nlohmann::json listed = nlohmann::json::parse(run.output);
  ASSERT_EQ(listed.size(), 3u) << run.output;
  EXPECT_EQ(listed[2]["name"], "web");
  EXPECT_EQ(listed[2]["pid"], web->pid);
  EXPECT_EQ(listed[2]["state"], "alive");
  EXPECT_EQ(listed[2]["endpoint"], "127.0.0.1:" + p);
  EXPECT_EQ(listed[2]["port"], port);
  EXPECT_EQ(listed[2]["health"], "tcp port " + p);
  EXPECT_EQ(listed[2]["log"], log);
  EXPECT_EQ(listed[0]["state"], "dead");

  // Stop: the process is gone and so is its record; a dead one's record is removed too.
  run = run_loom(dir, {"service", "stop", "web", "--grace", "5", "--dir", services});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_EQ(run.output, "stopped web (pid " + std::to_string(web->pid) + ")\n");
  EXPECT_FALSE(control::ServiceRegistry::alive(*web));
  const int brief_pid = listed[0]["pid"];
  run = run_loom(dir, {"service", "stop", "brief", "--dir", services});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_EQ(run.output, "brief was not running (pid " + std::to_string(brief_pid) +
                            " is gone); removed its record\n");
  run = run_loom(dir, {"service", "stop", "brief", "--dir", services});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.output,
            "error: no service named 'brief' in " + services + " (services there: lines)\n");
  run = run_loom(dir, {"service", "stop", "lines", "--dir", services});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  run = run_loom(dir, {"service", "ls", "--dir", services});
  EXPECT_EQ(run.output, "no services in " + services + "\n");
}

TEST(ServiceCli, ErrorsNameTheServiceAndWhatToDo) {
  testing::TempDir dir;
  const std::string services = (dir / "services").string();
  KillServicesAtExit cleanup{services};
  const std::string p = std::to_string(free_port());
  // Exits before it is ready: the end of its log is quoted; no record is left.
  auto run = run_loom(dir, {"service", "start", "bad", "--dir", services, "--port", p, "--", "sh",
                            "-c", "echo boom >&2; exit 3"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "error: service bad (sh) exited before it was ready; the end of its log " +
                            services + "/bad.log:\n  | boom\n");
  // Not ready in time: killed.
  run = run_loom(dir, {"service", "start", "slow", "--dir", services, "--port", p,
                       "--ready-timeout", "0.5", "--", "sleep", "30"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "error: service slow was not ready within 0.5 s (health: tcp port " + p +
                            "); it was killed; see its log " + services + "/slow.log\n");
  run = run_loom(dir, {"service", "ls", "--dir", services});
  EXPECT_EQ(run.output, "no services in " + services + "\n");
  run = run_loom(dir, {"service", "start", "gone", "--dir", services, "--", "no-such-program-x"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "error: cannot start 'no-such-program-x': not found in $PATH\n");
  run = run_loom(dir, {"service", "logs", "nope", "--dir", services});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.output,
            "error: no service named 'nope' in " + services + " (services there: none)\n");
  run = run_loom(dir, {"service", "start", "../x", "--dir", services, "--", "true"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.output,
            "error: service name '../x' is not letters, digits, '.', '_', '@' and '-' (not "
            "starting with '.')\n");
  run = run_loom(dir,
                 {"service", "start", "x", "--dir", services, "--health", "http:/h", "--", "true"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.output, "error: --health http:/h needs --port: the port the service listens on\n");
  run = run_loom(dir, {"service", "start", "--help"});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_TRUE(testing::contains(run.output, "--ready-timeout")) << run.output;
  EXPECT_TRUE(testing::contains(run.output, "an error when NAME runs already") ||
              testing::contains(run.output, "An error when NAME runs already"))
      << run.output;
}

}  // namespace
}  // namespace loom
