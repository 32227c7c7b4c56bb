// The rendezvous and membership state machine, transition by transition, on a manual clock:
// no network, no threads. The gRPC adapter around it is tested in coordinator_test.cpp and
// with real processes in tests/integration/launcher_test.cpp.
#include "control/membership.h"

#include <gtest/gtest.h>

#include <ostream>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::control {

void PrintTo(const Assignment& a, std::ostream* os) {
  *os << "{generation " << a.generation << ", node_rank " << a.node_rank << ", nnodes " << a.nnodes
      << ", rank_offset " << a.rank_offset << ", world_size " << a.world_size << ", restarts "
      << a.restarts << "}";
}

namespace {

using std::chrono::milliseconds;
using testing::error_of;

// Time moves only when a test says so.
struct ManualClock {
  Membership::Clock::time_point now{};
  void advance(milliseconds d) { now += d; }
  std::function<Membership::Clock::time_point()> fn() {
    return [this] { return now; };
  }
};

MembershipOptions options(int min_nodes, int max_nodes) {
  return {.min_nodes = min_nodes,
          .max_nodes = max_nodes,
          .last_call = milliseconds(1000),
          .max_restarts = 0,
          .node_timeout = milliseconds(5000),
          .worker_timeout = milliseconds(300),
          .waiting_expiry = milliseconds(3000)};
}

std::vector<std::string> event_texts(Membership& m) {
  std::vector<std::string> texts;
  for (const auto& e : m.take_events()) texts.push_back(e.text);
  return texts;
}

// Joins one node and expects it admitted: its assignment.
Assignment admit(Membership& m, const std::string& node, int nproc, int hint) {
  const JoinResult r = m.join(node, nproc, hint);
  EXPECT_EQ(r.outcome, JoinResult::kAdmitted) << node << ": " << r.reason;
  return r.assignment;
}

TEST(Membership, ARoundClosesWhenMaxNodesHaveJoined) {
  ManualClock clock;
  Membership m(options(2, 2), clock.fn());
  EXPECT_EQ(m.phase(), Phase::kGathering);
  JoinResult first = m.join("a", 2, 0);
  EXPECT_EQ(first.outcome, JoinResult::kWaiting);
  EXPECT_EQ(first.reason, "1 node(s) joined, at least 2 needed");
  EXPECT_EQ(m.generation(), 0);
  EXPECT_EQ(m.phase(), Phase::kGathering);
  // The second join closes the round at once: no last call once max_nodes joined.
  EXPECT_EQ(admit(m, "b", 3, 1), (Assignment{1, 1, 2, 2, 5, 0}));
  EXPECT_EQ(m.phase(), Phase::kRunning);
  EXPECT_EQ(m.generation(), 1);
  // The first agent's next (repeated) join collects its place.
  EXPECT_EQ(admit(m, "a", 2, 0), (Assignment{1, 0, 2, 0, 5, 0}));
  EXPECT_EQ(event_texts(m),
            std::vector<std::string>{"generation 1 starts: 2 node(s), world size 5"});
}

TEST(Membership, NodesAreOrderedByHintThenByIdAndGetRankOffsets) {
  ManualClock clock;
  Membership m(options(4, 4), clock.fn());
  EXPECT_EQ(m.join("z", 1, 1).outcome, JoinResult::kWaiting);
  EXPECT_EQ(m.join("y", 2, -1).outcome, JoinResult::kWaiting);  // no hint: after the hinted
  EXPECT_EQ(m.join("x", 3, -1).outcome, JoinResult::kWaiting);
  EXPECT_EQ(admit(m, "w", 4, 0), (Assignment{1, 0, 4, 0, 10, 0}));
  EXPECT_EQ(admit(m, "z", 1, 1), (Assignment{1, 1, 4, 4, 10, 0}));
  EXPECT_EQ(admit(m, "x", 3, -1), (Assignment{1, 2, 4, 5, 10, 0}));
  EXPECT_EQ(admit(m, "y", 2, -1), (Assignment{1, 3, 4, 8, 10, 0}));
}

TEST(Membership, TheLastCallClosesTheRoundWithMinNodes) {
  ManualClock clock;
  Membership m(options(1, 2), clock.fn());
  EXPECT_EQ(m.join("a", 2, 0).outcome, JoinResult::kWaiting);  // min reached: last call starts
  clock.advance(milliseconds(999));
  m.join("a", 2, 0);  // renewing does not restart the last call
  m.tick();
  EXPECT_EQ(m.phase(), Phase::kGathering);
  clock.advance(milliseconds(1));
  m.tick();
  EXPECT_EQ(m.phase(), Phase::kRunning);
  EXPECT_EQ(admit(m, "a", 2, 0), (Assignment{1, 0, 1, 0, 2, 0}));
  // A node that comes late waits for the next round; the running generation is unchanged.
  const JoinResult late = m.join("b", 2, 1);
  EXPECT_EQ(late.outcome, JoinResult::kWaiting);
  EXPECT_EQ(m.phase(), Phase::kRunning);
  EXPECT_EQ(m.status().world_size, 2);
}

TEST(Membership, AReportedFailureEndsTheGenerationAndRestartsAreCounted) {
  ManualClock clock;
  MembershipOptions o = options(1, 1);
  o.max_restarts = 1;
  Membership m(o, clock.fn());
  admit(m, "a", 1, 0);
  m.take_events();
  m.report_failure(1, 5, "rank 0 exited with code 5");
  EXPECT_EQ(m.phase(), Phase::kGathering);
  EXPECT_EQ(event_texts(m), std::vector<std::string>{"generation 1 ended: rank 0 exited with "
                                                     "code 5; restart 1 of 1"});
  const HeartbeatResult ended = m.node_heartbeat("a", 1);
  EXPECT_EQ(ended.state, HeartbeatResult::kEnded);
  EXPECT_EQ(ended.generation, 1);
  EXPECT_EQ(ended.reason, "rank 0 exited with code 5");
  EXPECT_EQ(admit(m, "a", 1, 0), (Assignment{2, 0, 1, 0, 1, 1}));
  m.report_failure(2, 9, "rank 0 exited with code 9");
  EXPECT_EQ(m.phase(), Phase::kFailed);
  EXPECT_TRUE(m.done());
  EXPECT_EQ(event_texts(m),
            (std::vector<std::string>{"generation 2 starts: 1 node(s), world size 1",
                                      "generation 2 ended: rank 0 exited with code 9; restarts "
                                      "exhausted (1), the job fails"}));
  const HeartbeatResult failed = m.node_heartbeat("a", 2);
  EXPECT_EQ(failed.state, HeartbeatResult::kFailed);
  EXPECT_EQ(failed.exit_code, 5);  // the first failure's code
  const JoinResult refused = m.join("a", 1, 0);
  EXPECT_EQ(refused.outcome, JoinResult::kJobFailed);
  EXPECT_EQ(refused.exit_code, 5);
  EXPECT_EQ(refused.reason, "the job failed: rank 0 exited with code 9");
}

TEST(Membership, AFailureOfAnotherGenerationIsIgnored) {
  ManualClock clock;
  Membership m(options(1, 1), clock.fn());
  m.report_failure(0, 3, "before any generation");
  EXPECT_EQ(m.phase(), Phase::kGathering);
  admit(m, "a", 1, 0);
  m.report_failure(2, 3, "a generation that does not exist yet");
  m.report_failure(0, 3, "an old generation");
  EXPECT_EQ(m.phase(), Phase::kRunning);
  EXPECT_EQ(m.status().restarts, 0);
}

TEST(Membership, ALostNodeEndsTheGenerationWithoutCountingAsARestart) {
  ManualClock clock;
  Membership m(options(1, 2), clock.fn());
  m.join("a", 2, 0);
  admit(m, "b", 2, 1);
  clock.advance(milliseconds(4000));
  m.node_heartbeat("a", 1);
  clock.advance(milliseconds(1000));  // b silent for exactly node_timeout: not yet lost
  m.tick();
  EXPECT_EQ(m.phase(), Phase::kRunning);
  clock.advance(milliseconds(1));
  m.tick();
  EXPECT_EQ(m.phase(), Phase::kGathering);
  const MembershipStatus s = m.status();
  EXPECT_EQ(s.restarts, 0);
  EXPECT_EQ(s.last_failure, "node 1 (b) lost: no heartbeat for 5000 ms");
  // The survivor re-joins; the last call closes a round of one at the smaller world size.
  EXPECT_EQ(m.join("a", 2, 0).outcome, JoinResult::kWaiting);
  clock.advance(milliseconds(1000));
  m.tick();
  EXPECT_EQ(admit(m, "a", 2, 0), (Assignment{2, 0, 1, 0, 2, 0}));
}

TEST(Membership, ASilentWorkerIsAFailureButOneThatNeverBeatIsNot) {
  ManualClock clock;
  MembershipOptions o = options(1, 1);
  o.max_restarts = 3;
  Membership m(o, clock.fn());
  admit(m, "a", 2, 0);
  // Rank 1 never heartbeats (a program without Loom's heartbeat): it is never hung.
  for (int i = 0; i < 10; ++i) {
    clock.advance(milliseconds(200));
    m.node_heartbeat("a", 1);
    m.tick();
  }
  EXPECT_EQ(m.phase(), Phase::kRunning);
  EXPECT_EQ(m.worker_heartbeat(0, 1, 12, 3.5, "training").state, HeartbeatResult::kRunning);
  clock.advance(milliseconds(300));
  m.tick();
  EXPECT_EQ(m.phase(), Phase::kRunning);
  clock.advance(milliseconds(1));
  m.tick();
  EXPECT_EQ(m.phase(), Phase::kGathering);
  const MembershipStatus s = m.status();
  EXPECT_EQ(s.restarts, 1);
  EXPECT_EQ(s.last_failure, "rank 0 missed heartbeats for 300 ms (hung or dead)");
}

TEST(Membership, TheJobFinishesWhenEveryMemberLeft) {
  ManualClock clock;
  Membership m(options(2, 2), clock.fn());
  m.join("a", 1, 0);
  admit(m, "b", 1, 1);
  m.leave("a", 0);  // another generation: ignored
  m.leave("a", 1);
  EXPECT_EQ(m.phase(), Phase::kRunning);
  EXPECT_EQ(m.node_heartbeat("b", 1).state, HeartbeatResult::kRunning);
  m.leave("b", 1);
  EXPECT_EQ(m.phase(), Phase::kFinished);
  EXPECT_TRUE(m.done());
  EXPECT_EQ(m.node_heartbeat("b", 1).state, HeartbeatResult::kFinished);
  const JoinResult r = m.join("c", 1, -1);
  EXPECT_EQ(r.outcome, JoinResult::kJobFinished);
  EXPECT_EQ(r.reason, "the job already finished");
  // A lost node or a failure cannot undo a finished job.
  clock.advance(milliseconds(60000));
  m.tick();
  m.report_failure(1, 4, "late");
  EXPECT_EQ(m.phase(), Phase::kFinished);
}

TEST(Membership, StopFailsTheJobFromGatheringOrRunningButNotAfterTheEnd) {
  ManualClock clock;
  {
    Membership m(options(2, 2), clock.fn());
    m.join("a", 1, 0);
    m.stop(130, "loom run on node a received signal 2");
    EXPECT_EQ(m.phase(), Phase::kFailed);
    const JoinResult r = m.join("a", 1, 0);
    EXPECT_EQ(r.outcome, JoinResult::kJobFailed);
    EXPECT_EQ(r.exit_code, 130);
    m.stop(143, "a second signal");  // the first stop's code stays
    EXPECT_EQ(m.node_heartbeat("a", 0).exit_code, 130);
  }
  {
    Membership m(options(1, 1), clock.fn());
    admit(m, "a", 1, 0);
    m.stop(143, "signal 15");
    const HeartbeatResult h = m.node_heartbeat("a", 1);
    EXPECT_EQ(h.state, HeartbeatResult::kFailed);
    EXPECT_EQ(h.exit_code, 143);
    EXPECT_EQ(h.reason, "signal 15");
  }
  {
    Membership m(options(1, 1), clock.fn());
    admit(m, "a", 1, 0);
    m.leave("a", 1);
    m.stop(143, "signal 15");
    EXPECT_EQ(m.phase(), Phase::kFinished);
  }
}

TEST(Membership, AWaitingAgentThatGoesAwayLeavesTheRound) {
  ManualClock clock;
  Membership m(options(2, 2), clock.fn());
  m.join("a", 1, 0);
  clock.advance(milliseconds(3001));
  m.tick();
  const JoinResult r = m.join("b", 1, 1);  // alone: a expired
  EXPECT_EQ(r.outcome, JoinResult::kWaiting);
  EXPECT_EQ(r.reason, "1 node(s) joined, at least 2 needed");
  EXPECT_EQ(admit(m, "a", 1, 0), (Assignment{1, 0, 2, 0, 2, 0}));  // back in time
}

TEST(Membership, NodesBeyondMaxNodesWaitForTheNextRound) {
  ManualClock clock;
  MembershipOptions o = options(2, 2);
  o.max_restarts = 1;
  Membership m(o, clock.fn());
  m.join("a", 1, 0);
  admit(m, "b", 1, 1);
  EXPECT_EQ(m.join("c", 1, 2).outcome, JoinResult::kWaiting);  // during generation 1
  m.report_failure(1, 1, "rank 1 exited with code 1");
  // c still waits; a's join makes two: the round closes without b.
  EXPECT_EQ(admit(m, "a", 1, 0), (Assignment{2, 0, 2, 0, 2, 1}));
  EXPECT_EQ(admit(m, "c", 1, 2), (Assignment{2, 1, 2, 1, 2, 1}));
  EXPECT_EQ(m.join("b", 1, 1).outcome, JoinResult::kWaiting);
}

TEST(Membership, RequestFieldsThatCannotBeRanksAreRefusedAndChangeNothing) {
  ManualClock clock;
  Membership m(options(1, 1), clock.fn());
  const std::string message = error_of<InvalidArgument>([&] { m.join("a", 0, 0); });
  EXPECT_EQ(message,
            "Join from node 'a': nproc 0 must be in [1, 4096], node_rank_hint 0 >= -1, and the "
            "node id 1 to 1024 bytes");
  EXPECT_THROW(m.join("a", 4097, 0), InvalidArgument);
  EXPECT_THROW(m.join("a", 1, -2), InvalidArgument);
  EXPECT_THROW(m.join("", 1, 0), InvalidArgument);
  EXPECT_THROW(m.join(std::string(1025, 'n'), 1, 0), InvalidArgument);
  EXPECT_EQ(m.phase(), Phase::kGathering);
  EXPECT_EQ(admit(m, "b", 3, 0), (Assignment{1, 0, 1, 0, 3, 0}));  // alone: nothing joined
  EXPECT_EQ(error_of<InvalidArgument>([&] { m.worker_heartbeat(3, 1, 0, 0, ""); }),
            "Heartbeat from rank 3 of generation 1, whose world size is 3");
  EXPECT_TRUE(m.status().workers.empty());
  // A rank of an old generation is not checked against this world, and not recorded.
  EXPECT_EQ(m.worker_heartbeat(7, 0, 0, 0, "").state, HeartbeatResult::kEnded);
  EXPECT_TRUE(m.status().workers.empty());
}

TEST(Membership, StatusReportsNodesAndWorkersOnTheInjectedClock) {
  ManualClock clock;
  Membership m(options(1, 1), clock.fn());
  admit(m, "a", 2, 0);
  m.worker_heartbeat(1, 1, 40, 2.5, "training");
  clock.advance(milliseconds(250));
  const MembershipStatus s = m.status();
  EXPECT_EQ(s.phase, Phase::kRunning);
  EXPECT_EQ(s.generation, 1);
  EXPECT_EQ(s.world_size, 2);
  ASSERT_EQ(s.nodes.size(), 1u);
  EXPECT_EQ(s.nodes[0].node_id, "a");
  EXPECT_EQ(s.nodes[0].nproc, 2);
  EXPECT_EQ(s.nodes[0].seconds_since_heartbeat, 0.25);
  ASSERT_EQ(s.workers.size(), 1u);
  EXPECT_EQ(s.workers[0].rank, 1);
  EXPECT_EQ(s.workers[0].step, 40);
  EXPECT_EQ(s.workers[0].throughput, 2.5);
  EXPECT_EQ(s.workers[0].state, "training");
  EXPECT_EQ(s.workers[0].seconds_since_heartbeat, 0.25);
}

TEST(Membership, ANodeOfAnOldGenerationHearsThatItEnded) {
  ManualClock clock;
  MembershipOptions o = options(1, 1);
  o.max_restarts = 2;
  Membership m(o, clock.fn());
  admit(m, "a", 1, 0);
  m.report_failure(1, 2, "rank 0 exited with code 2");
  admit(m, "a", 1, 0);
  const HeartbeatResult h = m.node_heartbeat("a", 1);
  EXPECT_EQ(h.state, HeartbeatResult::kEnded);
  EXPECT_EQ(h.generation, 2);
  EXPECT_EQ(m.node_heartbeat("a", 2).state, HeartbeatResult::kRunning);
}

}  // namespace
}  // namespace loom::control
