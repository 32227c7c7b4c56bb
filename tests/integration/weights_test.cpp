// Weight snapshots between real processes: a trainer (tests/programs/weights_probe.cpp) publishes
// its parameters after every one of 1,000 steps while subscriber processes receive versions as
// fast as they can, each checking every version it receives against its own replay of the
// training, bitwise; over shared memory, over TCP on loopback, and over TCP between two network
// namespaces. And a publisher killed with SIGKILL: named to its subscribers, its segment replaced.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "harness/harness.h"
#include "harness/network_namespaces.h"
#include "loom/control/weights.h"
#include "loom/error.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;
using testing::TempDir;

const std::string kProbe = LOOM_BINARY_DIR "/tests/loom_weights_probe";
constexpr int kSteps = 1000;

std::string unique_name(const std::string& what) {
  return "itest-" + what + "-" + std::to_string(::getpid());
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Waits up to 60 s for `path`; its first line.
std::string wait_for_line(const fs::path& path) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(path) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  std::string line;
  std::ifstream in(path);
  std::getline(in, line);
  return line;
}

struct Process {
  util::Subprocess process;
  fs::path output;
};

Process spawn(const TempDir& dir, const std::string& label, std::vector<std::string> argv) {
  const fs::path output = dir / (label + ".out");
  return {util::Subprocess::spawn({.argv = std::move(argv), .output = output}), output};
}

// Every subscriber checked a strictly increasing run of versions ending at the last one, each
// equal to the replay bitwise (the probe counts mismatches and fails on one).
void expect_report(const TempDir& dir, const std::string& label, Process& subscriber) {
  const auto status = subscriber.process.wait_for(std::chrono::seconds(120));
  ASSERT_TRUE(status.has_value()) << label << " still running\n" << read_file(subscriber.output);
  EXPECT_TRUE(status->ok()) << label << " " << status->describe() << "\n"
                            << read_file(subscriber.output);
  const json report = json::parse(read_file(dir / (label + ".json")));
  EXPECT_EQ(report["mismatches"], 0) << label;
  EXPECT_EQ(report["last"], kSteps) << label;
  EXPECT_GE(report["checked"].get<int>(), 2) << label;
  const auto versions = report["versions"].get<std::vector<int64_t>>();
  EXPECT_EQ(static_cast<int64_t>(versions.size()), report["checked"].get<int64_t>());
  for (size_t i = 1; i < versions.size(); ++i) EXPECT_LT(versions[i - 1], versions[i]) << label;
  std::printf("%s: checked %d of %d versions bitwise, %d torn reads retried\n", label.c_str(),
              report["checked"].get<int>(), kSteps + 1, report["torn_reads"].get<int>());
}

TEST(WeightSnapshots, SubscriberProcessesCheckEveryVersionBitwiseOverSharedMemoryAndTcp) {
  TempDir dir;
  const std::string name = unique_name("run");
  const std::string reports = (dir / "shm.json").string() + "," + (dir / "tcp.json").string();
  Process publisher = spawn(dir, "publisher",
                            {kProbe, "publish", name, std::to_string(kSteps), "127.0.0.1:0",
                             (dir / "endpoint").string(), reports});
  const std::string endpoint = wait_for_line(dir / "endpoint");
  ASSERT_EQ(endpoint.rfind("127.0.0.1:", 0), 0u) << read_file(publisher.output);
  Process shm = spawn(
      dir, "shm", {kProbe, "subscribe", name, std::to_string(kSteps), (dir / "shm.json").string()});
  Process tcp =
      spawn(dir, "tcp",
            {kProbe, "subscribe", endpoint, std::to_string(kSteps), (dir / "tcp.json").string()});
  expect_report(dir, "shm", shm);
  expect_report(dir, "tcp", tcp);
  const auto status = publisher.process.wait_for(std::chrono::seconds(60));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->ok()) << read_file(publisher.output);
  EXPECT_FALSE(fs::exists("/dev/shm/loom-weights-" + name));
}

TEST(WeightSnapshots, ATcpSubscriberInAnotherNetworkNamespaceChecksEveryVersion) {
  testing::NetworkNamespaces net;
  if (!net.ok()) GTEST_SKIP() << "cannot create network namespaces (needs root and iproute2)";
  TempDir dir;
  const std::string name = unique_name("netns");
  std::vector<std::string> publish = net.exec_in(0);
  publish.insert(publish.end(), {kProbe, "publish", name, std::to_string(kSteps),
                                 testing::NetworkNamespaces::address(0) + ":0",
                                 (dir / "endpoint").string(), (dir / "far.json").string()});
  Process publisher = spawn(dir, "publisher", publish);
  const std::string endpoint = wait_for_line(dir / "endpoint");
  ASSERT_EQ(endpoint.rfind("10.231.0.1:", 0), 0u) << read_file(publisher.output);
  std::vector<std::string> subscribe = net.exec_in(1);
  subscribe.insert(subscribe.end(), {kProbe, "subscribe", endpoint, std::to_string(kSteps),
                                     (dir / "far.json").string()});
  Process far = spawn(dir, "far", subscribe);
  expect_report(dir, "far", far);
  const auto status = publisher.process.wait_for(std::chrono::seconds(60));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->ok()) << read_file(publisher.output);
}

// SIGKILL leaves the segment behind: subscribers name the dead publisher, and the next
// publisher under the name removes it and takes over.
TEST(WeightSnapshots, AKilledPublisherIsNamedAndItsSegmentReplaced) {
  TempDir dir;
  const std::string name = unique_name("killed");
  // Its subscriber never reports: the publisher waits for it after version 0.
  Process publisher = spawn(dir, "publisher",
                            {kProbe, "publish", name, "3", "", (dir / "endpoint").string(),
                             (dir / "never.json").string()});
  ASSERT_EQ(wait_for_line(dir / "endpoint"), "-") << read_file(publisher.output);
  control::WeightSubscriber subscriber(name);
  EXPECT_EQ(subscriber.latest(-1, milliseconds(10000)).version, 0);
  const pid_t pid = publisher.process.pid();
  publisher.process.signal(SIGKILL);
  publisher.process.wait();
  EXPECT_TRUE(fs::exists("/dev/shm/loom-weights-" + name));
  EXPECT_EQ(testing::error_of<Timeout>([&] { subscriber.latest(0, milliseconds(100)); }),
            "weights \"" + name + "\": no publisher within 100 ms: its publisher (pid " +
                std::to_string(pid) + ") died without removing /dev/shm/loom-weights-" + name +
                ". Start the publisher on this host under that name (a publisher on another "
                "host is reached as HOST:PORT, its endpoint())");
  control::WeightPublisher replacement(name);
  EXPECT_FALSE(fs::exists("/dev/shm/loom-weights-" + name));  // removed; created at publish
  replacement.publish(1, {{"w", at::ones({2})}});
  const control::WeightVersion version = subscriber.latest(0, milliseconds(10000));
  EXPECT_EQ(version.version, 1);
  EXPECT_TRUE(at::equal(version.tensors.at("w"), at::ones({2})));
}

// The documented protocol from a Python program with no Loom and no third-party module
// (tests/programs/weights_client.py, the client docs/launcher.md shows), checksum included.
TEST(WeightSnapshots, APythonProgramReceivesTheNewestVersionOverTheDocumentedProtocol) {
  TempDir dir;
  control::WeightPublisher publisher(unique_name("python"), {.listen = "127.0.0.1:0"});
  publisher.publish(2, {{"w", at::zeros({2, 3}, at::kFloat)}, {"step", at::zeros({}, at::kLong)}});
  publisher.publish(3, {{"w", at::arange(6, at::kFloat).reshape({2, 3}).div(4)},
                        {"step", at::full({}, 3, at::kLong)}});
  const testing::ProgramResult result = testing::run_program(
      {"python3", LOOM_SOURCE_DIR "/tests/programs/weights_client.py", publisher.endpoint(), "2"},
      dir.path());
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output,
            R"({"tensors": {"step": {"dtype": "int64", "shape": [], "values": [3]}, )"
            R"("w": {"dtype": "float32", "shape": [2, 3], "values": [0.0, 0.25, 0.5, 0.75, 1.0, )"
            R"(1.25]}}, "version": 3})"
            "\n");
}

}  // namespace
}  // namespace loom
