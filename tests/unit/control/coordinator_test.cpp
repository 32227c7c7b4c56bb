// The coordinator: job tokens, where it may listen, and rendezvous rounds driven through its
// client API by threads standing in for agents. The launcher itself is tested with real
// processes in tests/integration/launcher_test.cpp.
#include "loom/control/coordinator.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "control/client.h"
#include "harness/certs.h"
#include "harness/harness.h"
#include "loom/control/store.h"
#include "loom/error.h"

namespace loom::control {
namespace {

using std::chrono::milliseconds;
using testing::error_of;
using testing::TempDir;

TEST(Coordinator, RefusesAWrongOrMissingToken) {
  Coordinator coordinator({.token = "secret"});
  CoordinatorStore right(coordinator.address(), "secret");
  right.set("k", "v");
  CoordinatorStore wrong(coordinator.address(), "guess");
  auto message = error_of<CommError>([&] { wrong.get("k", milliseconds(100)); });
  EXPECT_NE(message.find("refused the job token"), std::string::npos) << message;
  CoordinatorStore none(coordinator.address(), "");
  EXPECT_THROW(none.set("k", "w"), CommError);
  EXPECT_EQ(right.get("k", milliseconds(100)), "v");
}

TEST(Coordinator, ListensBeyondLoopbackOnlyWhenAllowedAndWithAToken) {
  auto message = error_of<InvalidArgument>([] { Coordinator({.address = "0.0.0.0:0"}); });
  EXPECT_NE(message.find("--coordinator-public"), std::string::npos) << message;
  message = error_of<InvalidArgument>(
      [] { Coordinator({.address = "0.0.0.0:0", .allow_non_loopback = true}); });
  EXPECT_NE(message.find("token"), std::string::npos) << message;
  Coordinator open({.address = "0.0.0.0:0", .allow_non_loopback = true, .token = generate_token()});
  EXPECT_NE(open.address().find(':'), std::string::npos);
}

TEST(Coordinator, UnreachableCoordinatorIsAClearError) {
  CoordinatorStore store("127.0.0.1:1", "", milliseconds(300));
  auto message = error_of<Timeout>([&] { store.set("k", "v"); });
  EXPECT_NE(message.find("127.0.0.1:1"), std::string::npos) << message;
}

v1::JoinReply join(const CoordinatorClient& client, const std::string& node, int nproc, int hint) {
  v1::JoinRequest req;
  req.set_node_id(node);
  req.set_nproc(nproc);
  req.set_node_rank_hint(hint);
  req.set_timeout_ms(10000);
  return client.call("Join", &CoordinatorClient::Stub::Join, req, milliseconds(10000));
}

TEST(Coordinator, ARoundAssignsNodeRanksAndRankOffsets) {
  Coordinator coordinator({.min_nodes = 3, .max_nodes = 3});
  CoordinatorClient client(coordinator.address(), "", milliseconds(5000));
  std::vector<v1::JoinReply> replies(3);
  std::vector<std::thread> agents;
  const int nprocs[] = {2, 3, 1};
  for (int i = 0; i < 3; ++i) {
    // Hints order the nodes: agent i asks for node rank 2 - i.
    agents.emplace_back(
        [&, i] { replies[i] = join(client, "node" + std::to_string(i), nprocs[i], 2 - i); });
  }
  for (auto& t : agents) t.join();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(replies[i].outcome(), v1::JOIN_ADMITTED);
    EXPECT_EQ(replies[i].generation(), 1);
    EXPECT_EQ(replies[i].node_rank(), 2 - i);
    EXPECT_EQ(replies[i].world_size(), 6);
  }
  EXPECT_EQ(replies[2].rank_offset(), 0);  // node rank 0: 1 worker
  EXPECT_EQ(replies[1].rank_offset(), 1);  // node rank 1: 3 workers
  EXPECT_EQ(replies[0].rank_offset(), 4);  // node rank 2: 2 workers
}

// A worker heartbeat of `generation` carrying a report of one step of `busy` seconds.
v1::HeartbeatReply report_step(const CoordinatorClient& client, int rank, int64_t generation,
                               int64_t step, double busy) {
  v1::HeartbeatRequest beat;
  beat.set_rank(rank);
  beat.set_generation(generation);
  beat.set_step(step);
  v1::StepReport& report = *beat.mutable_report();
  report.set_steps(1);
  report.set_last_step(step);
  report.set_step_seconds(0.5);
  (*report.mutable_phase_seconds())["forward_backward"] = busy;
  (*report.mutable_phase_seconds())["comm_wait"] = 0.5 - busy;
  report.set_tokens_per_second(100 * (rank + 1));
  report.set_mfu(-1);
  return client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat);
}

// The lines of a Prometheus exposition that are samples (no comments).
std::vector<std::string> samples(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != '#') out.push_back(line);
  }
  return out;
}

TEST(Coordinator, ServesTheJobsMetricsAndStragglersOverHttp) {
  Coordinator coordinator({.metrics_address = "127.0.0.1:0", .straggler_window = 2});
  const std::string where = coordinator.metrics_address();
  ASSERT_EQ(where.rfind("127.0.0.1:", 0), 0u) << where;
  CoordinatorClient client(coordinator.address(), "", milliseconds(5000));
  ASSERT_EQ(join(client, "a", 2, 0).generation(), 1);
  for (int64_t step = 0; step < 2; ++step) {
    report_step(client, 0, 1, step, 0.125);
    report_step(client, 1, 1, step, 0.375);  // three times rank 0's work: a straggler
  }
  // Ignored: a report of another generation, and a heartbeat without finished steps.
  report_step(client, 0, 7, 9, 0.125);
  v1::HeartbeatRequest idle;
  idle.set_rank(1);
  idle.set_generation(1);
  idle.set_step(5);
  client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, idle);

  // A malformed report is refused whole: the heartbeat changes nothing.
  v1::HeartbeatRequest bad;
  bad.set_rank(0);
  bad.set_generation(1);
  bad.set_step(99);
  bad.mutable_report()->set_steps(1);
  bad.mutable_report()->set_step_seconds(-1);
  const auto refused = error_of<InvalidArgument>(
      [&] { client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, bad); });
  EXPECT_NE(refused.find("step_seconds must be finite and >= 0, got -1"), std::string::npos)
      << refused;

  httplib::Client http("http://" + where);
  const auto res = http.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  std::vector<std::string> lines;
  for (const std::string& line : samples(res->body)) {
    if (line.rfind("loom_rank_heartbeat_age_seconds", 0) != 0) lines.push_back(line);
  }
  EXPECT_EQ(lines, (std::vector<std::string>{
                       "loom_generation 1",
                       "loom_restarts_total 0",
                       "loom_world_size 2",
                       "loom_job_running 1",
                       "loom_job_tokens_per_second 300",
                       "loom_job_samples_per_second 0",
                       "loom_job_step_seconds 0.5",
                       "loom_job_goodput_ratio 0",
                       "loom_job_loss 0",
                       "loom_job_stragglers 1",
                       "loom_job_hung 0",
                       "loom_rank_step{rank=\"0\"} 1",
                       "loom_rank_step{rank=\"1\"} 1",
                       "loom_rank_step_seconds{rank=\"0\"} 0.5",
                       "loom_rank_step_seconds{rank=\"1\"} 0.5",
                       "loom_rank_busy_seconds{rank=\"0\"} 0.125",
                       "loom_rank_busy_seconds{rank=\"1\"} 0.375",
                       "loom_rank_phase_seconds{rank=\"0\",phase=\"comm_wait\"} 0.375",
                       "loom_rank_phase_seconds{rank=\"0\",phase=\"forward_backward\"} 0.125",
                       "loom_rank_phase_seconds{rank=\"1\",phase=\"comm_wait\"} 0.125",
                       "loom_rank_phase_seconds{rank=\"1\",phase=\"forward_backward\"} 0.375",
                       "loom_rank_tokens_per_second{rank=\"0\"} 100",
                       "loom_rank_tokens_per_second{rank=\"1\"} 200",
                       "loom_rank_samples_per_second{rank=\"0\"} 0",
                       "loom_rank_samples_per_second{rank=\"1\"} 0",
                       "loom_rank_resident_memory_bytes{rank=\"0\"} 0",
                       "loom_rank_resident_memory_bytes{rank=\"1\"} 0",
                       "loom_rank_straggler{rank=\"0\"} 0",
                       "loom_rank_straggler{rank=\"1\"} 1",
                   }));
  const auto api = http.Get("/api/metrics");
  ASSERT_TRUE(api);
  EXPECT_EQ(api->get_header_value("Content-Type"), "application/json");
  const auto j = nlohmann::json::parse(api->body);
  ASSERT_EQ(j["stragglers"].size(), 1u);
  EXPECT_EQ(j["stragglers"][0]["rank"], 1);
  EXPECT_EQ(j["stragglers"][0]["phase"], "forward_backward");
  EXPECT_EQ(j["stragglers"][0]["ratio"], 3.0);
  EXPECT_EQ(j["ranks"][1]["series"].size(), 2u);
  EXPECT_EQ(http.Get("/nothing")->status, 404);
}

TEST(Coordinator, AMetricsEndpointBeyondLoopbackNeedsTheTokenAsABearer) {
  auto message = error_of<InvalidArgument>(
      [] { Coordinator({.token = "t", .metrics_address = "0.0.0.0:0"}); });
  EXPECT_NE(message.find("needs --coordinator-public and a job token"), std::string::npos)
      << message;
  message = error_of<InvalidArgument>([] { Coordinator({.metrics_address = "9400"}); });
  EXPECT_NE(message.find("must be host:port"), std::string::npos) << message;
  Coordinator open({.allow_non_loopback = true, .token = "t", .metrics_address = "0.0.0.0:0"});
  const std::string port = open.metrics_address().substr(open.metrics_address().rfind(':') + 1);
  httplib::Client http("http://127.0.0.1:" + port);
  const auto refused = http.Get("/metrics");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  EXPECT_EQ(refused->body, "wrong or missing job token (Authorization: Bearer <token>)\n");
  EXPECT_EQ(http.Get("/metrics", {{"Authorization", "Bearer wrong"}})->status, 401);
  const auto ok = http.Get("/metrics", {{"Authorization", "Bearer t"}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(samples(ok->body)[0], "loom_generation 0");
}

TEST(Coordinator, AReportedFailureEndsTheGenerationAndCountsAsARestart) {
  Coordinator coordinator({.max_restarts = 1});
  CoordinatorClient client(coordinator.address(), "", milliseconds(5000));
  EXPECT_EQ(join(client, "a", 1, 0).generation(), 1);
  v1::FailureRequest failure;
  failure.set_node_id("a");
  failure.set_generation(1);
  failure.set_exit_code(5);
  failure.set_reason("rank 0 exited with code 5");
  client.call("ReportFailure", &CoordinatorClient::Stub::ReportFailure, failure);
  v1::HeartbeatRequest beat;
  beat.set_node_id("a");
  beat.set_rank(-1);
  beat.set_generation(1);
  EXPECT_EQ(client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat).state(), v1::ENDED);
  const auto second = join(client, "a", 1, 0);
  EXPECT_EQ(second.generation(), 2);
  EXPECT_EQ(second.restarts(), 1);
  failure.set_generation(2);
  client.call("ReportFailure", &CoordinatorClient::Stub::ReportFailure, failure);
  beat.set_generation(2);
  const auto over = client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat);
  EXPECT_EQ(over.state(), v1::FAILED);
  EXPECT_EQ(over.exit_code(), 5);  // the first failure's code
  EXPECT_TRUE(coordinator.done());
}

TEST(Coordinator, ASilentWorkerEndsItsGeneration) {
  Coordinator coordinator({.max_restarts = 3, .worker_timeout = milliseconds(300)});
  CoordinatorClient client(coordinator.address(), "", milliseconds(5000));
  join(client, "a", 1, 0);
  v1::HeartbeatRequest worker;
  worker.set_rank(0);
  worker.set_generation(1);
  worker.set_step(12);
  const auto last_beat = std::chrono::steady_clock::now();  // before it is sent
  client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, worker);
  const auto status =
      client.call("GetStatus", &CoordinatorClient::Stub::GetStatus, v1::StatusRequest());
  ASSERT_EQ(status.workers_size(), 1);
  EXPECT_EQ(status.workers(0).step(), 12);
  // Polled until the generation ends (a condition, not a sleep: a loaded machine only makes it
  // later), and not before the worker timeout has passed since the last heartbeat.
  v1::JobStatus after;
  const auto give_up = last_beat + std::chrono::seconds(30);
  do {
    std::this_thread::sleep_for(milliseconds(20));
    after = client.call("GetStatus", &CoordinatorClient::Stub::GetStatus, v1::StatusRequest());
  } while (after.state() != v1::ENDED && std::chrono::steady_clock::now() < give_up);
  EXPECT_GE(std::chrono::steady_clock::now() - last_beat, milliseconds(300));
  EXPECT_EQ(after.state(), v1::ENDED);
  EXPECT_NE(after.last_failure().find("rank 0 missed heartbeats"), std::string::npos)
      << after.last_failure();
}

// RPC fields are untrusted input: a node's worker count and rank hint, a worker's rank, and
// timeouts at the ends of int64's range.
TEST(Coordinator, OutOfRangeRequestFieldsAreInvalidArgumentNamingThem) {
  Coordinator coordinator({});
  CoordinatorClient client(coordinator.address(), "", milliseconds(5000));
  for (const auto& [node, nproc, hint] : std::vector<std::tuple<std::string, int, int>>{
           {"a", 0, 0}, {"a", -5, 0}, {"a", 4097, 0}, {"a", 1, -7}, {"", 1, 0}}) {
    SCOPED_TRACE(std::to_string(nproc) + " " + std::to_string(hint) + " '" + node + "'");
    const std::string message = error_of<InvalidArgument>([&] { join(client, node, nproc, hint); });
    EXPECT_NE(message.find("Join"), std::string::npos) << message;
    EXPECT_NE(message.find("nproc " + std::to_string(nproc)), std::string::npos) << message;
  }
  // None of them joined: a valid node makes the round, alone, at world size 2.
  const auto admitted = join(client, "a", 2, 0);
  EXPECT_EQ(admitted.outcome(), v1::JOIN_ADMITTED);
  EXPECT_EQ(admitted.world_size(), 2);

  v1::HeartbeatRequest beat;
  beat.set_rank(2);  // world size 2: ranks 0 and 1
  beat.set_generation(1);
  std::string message = error_of<InvalidArgument>(
      [&] { client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat); });
  EXPECT_NE(message.find("rank 2"), std::string::npos) << message;
  beat.set_rank(1 << 30);
  EXPECT_THROW(client.call("Heartbeat", &CoordinatorClient::Stub::Heartbeat, beat),
               InvalidArgument);
  const auto status =
      client.call("GetStatus", &CoordinatorClient::Stub::GetStatus, v1::StatusRequest());
  EXPECT_EQ(status.workers_size(), 0);  // nothing was recorded for them

  // INT64_MAX ms must not overflow the deadline into the past: the Get waits for the key.
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    v1::SetRequest set;
    set.set_key("late");
    set.set_value("v");
    client.call("Set", &CoordinatorClient::Stub::Set, set);
  });
  v1::GetRequest get;
  get.set_key("late");
  get.set_timeout_ms(INT64_MAX);
  const auto got = client.call("Get", &CoordinatorClient::Stub::Get, get);
  setter.join();
  EXPECT_TRUE(got.found());
  EXPECT_EQ(got.value(), "v");
  get.set_key("never");
  get.set_timeout_ms(INT64_MIN);  // negative: do not wait
  EXPECT_FALSE(client.call("Get", &CoordinatorClient::Stub::Get, get).found());
}

// ---- TLS, with certificates the test makes (openssl) ----

class CoordinatorTls : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::have_openssl()) GTEST_SKIP() << "no openssl (tools/install-deps.sh)";
    ca_ = std::make_unique<testing::TestCa>(dir_.path(), "job");
    server_ = ca_->issue("server", {"127.0.0.1"});
    client_ = ca_->issue("client", {"127.0.0.1"});
  }
  // A coordinator with the job CA's server certificate; `mutual`: clients need one too.
  std::unique_ptr<Coordinator> start(bool mutual) {
    return std::make_unique<Coordinator>(CoordinatorOptions{
        .token = "t",
        .tls = {server_.cert, server_.key, mutual ? ca_->cert() : std::filesystem::path()}});
  }
  TlsFiles client_tls() const { return {client_.cert, client_.key, ca_->cert()}; }

  TempDir dir_;
  std::unique_ptr<testing::TestCa> ca_;
  testing::TestCa::Issued server_, client_;
};

TEST_F(CoordinatorTls, AClientWithACertificateOfTheJobsCaIsServed) {
  auto coordinator = start(true);
  CoordinatorStore store(coordinator->address(), "t", milliseconds(5000), client_tls());
  store.set("k", "over tls");
  EXPECT_EQ(store.get("k", milliseconds(100)), "over tls");
  // The token is still checked under TLS.
  CoordinatorStore no_token(coordinator->address(), "", milliseconds(5000), client_tls());
  EXPECT_THROW(no_token.set("k", "w"), CommError);
}

// What a refused client sees: gRPC reports a failed handshake as a coordinator that never
// answers (the client waits for the channel to become ready), hence Timeout, whose message
// names TLS among the causes. A client with `good` files then finds that the coordinator
// kept nothing from it.
void expect_refused(const std::string& address, const TlsFiles& tls, const std::string& hint,
                    const TlsFiles* good) {
  CoordinatorStore store(address, "t", milliseconds(1500), tls);
  const std::string message = error_of<Timeout>([&] { store.set("intruder", "x"); });
  EXPECT_EQ(message, "the coordinator at " + address + " did not answer Set within 1500 ms: is " +
                         "it running and reachable?" + hint);
  if (good == nullptr) return;
  CoordinatorStore check(address, "t", milliseconds(5000), *good);
  EXPECT_FALSE(check.check({"intruder"}));
}

const std::string kTlsHint =
    " With TLS, also check that its certificate is signed by --tls-ca and names this address, "
    "and that it accepts this node's certificate";

TEST_F(CoordinatorTls, APlaintextClientIsRefused) {
  auto coordinator = start(true);
  const TlsFiles good = client_tls();
  expect_refused(coordinator->address(), {}, " If it uses TLS, this client needs --tls-ca too",
                 &good);
}

TEST_F(CoordinatorTls, AClientWhoseCertificateAnotherCaSignedIsRefused) {
  auto coordinator = start(true);
  testing::TestCa other(dir_.path(), "other");
  const auto intruder = other.issue("intruder", {"127.0.0.1"});
  // It trusts the job's CA (so it would accept the coordinator), but the coordinator does not
  // accept it; nor one without any certificate.
  const TlsFiles good = client_tls();
  expect_refused(coordinator->address(), {intruder.cert, intruder.key, ca_->cert()}, kTlsHint,
                 &good);
  expect_refused(coordinator->address(), {{}, {}, ca_->cert()}, kTlsHint, &good);
}

TEST_F(CoordinatorTls, AClientWithoutTheJobsCaDoesNotTrustTheCoordinator) {
  auto coordinator = start(false);  // even without mutual TLS
  testing::TestCa other(dir_.path(), "other");
  const TlsFiles good{{}, {}, ca_->cert()};
  expect_refused(coordinator->address(), {{}, {}, other.cert()}, kTlsHint, &good);
  // With the job's CA and no certificate of its own, it is served: TLS one way.
  CoordinatorStore one_way(coordinator->address(), "t", milliseconds(5000), {{}, {}, ca_->cert()});
  one_way.set("k", "v");
  EXPECT_EQ(one_way.get("k", milliseconds(100)), "v");
}

TEST_F(CoordinatorTls, ACertificateThatDoesNotNameTheAddressIsNotTrusted) {
  const auto elsewhere = ca_->issue("elsewhere", {"10.9.9.9"});
  Coordinator coordinator({.token = "t", .tls = {elsewhere.cert, elsewhere.key, {}}});
  // Its CA is the job's, but it is for 10.9.9.9, not the 127.0.0.1 dialled.
  expect_refused(coordinator.address(), {{}, {}, ca_->cert()}, kTlsHint, nullptr);
}

TEST_F(CoordinatorTls, MissingOrMalformedFilesAreErrorsNamingTheFile) {
  const std::filesystem::path missing = dir_ / "missing.pem";
  std::string message = error_of<IoError>([&] {
    Coordinator({.tls = {missing, server_.key, ca_->cert()}});
  });
  EXPECT_EQ(message, "cannot read the TLS certificate (--tls-cert) \"" + missing.string() +
                         "\": No such file or directory");
  message = error_of<IoError>([&] {
    CoordinatorStore("127.0.0.1:1", "", milliseconds(100),
                     {client_.cert, client_.key, dir_.path()});
  });
  EXPECT_EQ(message, "cannot read the TLS CA certificate (--tls-ca) \"" + dir_.path().string() +
                         "\": it is a directory");
  // A certificate given as the key: not a private key.
  message = error_of<InvalidArgument>([&] {
    Coordinator({.tls = {server_.cert, server_.cert, ca_->cert()}});
  });
  EXPECT_EQ(message, "the TLS private key (--tls-key) \"" + server_.cert.string() +
                         "\" is not a PEM file with a PRIVATE KEY block (-----BEGIN ...PRIVATE "
                         "KEY-----)");
  message = error_of<InvalidArgument>([&] { Coordinator({.tls = {{}, {}, ca_->cert()}}); });
  EXPECT_EQ(message,
            "a coordinator with TLS needs its certificate and private key (--tls-cert and "
            "--tls-key)");
  message = error_of<InvalidArgument>([&] {
    CoordinatorStore("127.0.0.1:1", "", milliseconds(100), {client_.cert, client_.key, {}});
  });
  EXPECT_EQ(message,
            "a client with TLS needs the CA certificate that verifies the coordinator "
            "(--tls-ca)");
}

}  // namespace
}  // namespace loom::control
