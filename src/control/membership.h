// The coordinator's rendezvous and membership protocol as a pure state machine: which agents
// make up a generation, when a generation ends, when the job is over. No network, no gRPC
// types and no threads of its own: the coordinator's gRPC service (coordinator.cpp) is a thin
// adapter that turns RPCs into the transitions below, and the unit tests drive them one by one
// with a manual clock (tests/unit/control/membership_test.cpp).
//
// Transitions (from -> to: cause):
//   kGathering -> kRunning    the round closes: max_nodes joined, or min_nodes and last_call over
//   kRunning   -> kGathering  a failure within max_restarts (reported, or a silent worker), or a
//                             node lost (silent for node_timeout; not a failure)
//   kRunning   -> kFailed     a failure past max_restarts
//   kRunning   -> kFinished   every member of the generation left
//   kGathering, kRunning -> kFailed   stop() (an agent received a signal)
// kFinished and kFailed are final. Private to Loom.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/control/coordinator.h"

namespace loom::control {

struct MembershipOptions {
  int min_nodes = 1;  // a round closes once this many agents joined and ...
  int max_nodes = 1;  // ... this many joined, or last_call passed since min_nodes was reached
  std::chrono::milliseconds last_call = kDefaultLastCall;
  // Generations ended by a failure beyond this many fail the job; a lost node does not count.
  int max_restarts = 0;
  // An agent of the running generation silent this long is lost (not a failure).
  std::chrono::milliseconds node_timeout = kDefaultNodeTimeout;
  // A worker that heartbeated in this generation and then is silent this long is hung (a
  // failure).
  std::chrono::milliseconds worker_timeout = kDefaultWorkerTimeout;
  // A waiting agent that has not renewed its join this long went away and leaves the round.
  std::chrono::milliseconds waiting_expiry{std::chrono::seconds(3)};
};

// Where the job stands.
enum class Phase {
  kGathering,  // between generations: agents join the next round
  kRunning,    // a generation runs
  kFinished,   // every member of the last generation left successfully (final)
  kFailed,     // restarts exhausted, or an agent stopped the job (final)
};
const char* phase_name(Phase phase);

// A node's place in a generation, as its agent needs it to start the workers.
struct Assignment {
  int64_t generation = 0;  // 1 for the first round, +1 per round
  int node_rank = 0;
  int nnodes = 0;
  int rank_offset = 0;  // global rank of this node's local rank 0
  int world_size = 0;
  int restarts = 0;  // generations ended by a failure before this one

  bool operator==(const Assignment& o) const {
    return generation == o.generation && node_rank == o.node_rank && nnodes == o.nnodes &&
           rank_offset == o.rank_offset && world_size == o.world_size && restarts == o.restarts;
  }
};

// What join() answers.
struct JoinResult {
  enum Outcome {
    kAdmitted,     // `assignment` says where the node runs
    kWaiting,      // the round has not closed: join again (the node keeps its place)
    kJobFinished,  // the job is over and succeeded: nothing to join
    kJobFailed,    // the job is over and failed: `exit_code`
  };
  Outcome outcome = kWaiting;
  Assignment assignment;  // kAdmitted
  int exit_code = 0;      // kJobFailed: the first failure's code
  std::string reason;     // for people: why not admitted
};

// What a heartbeat of generation g learns.
struct HeartbeatResult {
  enum State {
    kRunning,   // g is running
    kEnded,     // g is over (or was never this node's): stop the workers, join again
    kFinished,  // the job finished
    kFailed,    // the job failed: `exit_code`
  };
  State state = kEnded;
  int64_t generation = 0;  // the current generation
  int exit_code = 0;       // the first failure's code (kFailed)
  std::string reason;      // why the last generation ended, for people
};

// A snapshot for dashboards (GetStatus).
struct MembershipStatus {
  struct Node {
    std::string node_id;
    int node_rank = 0;
    int nproc = 0;
    double seconds_since_heartbeat = 0;
  };
  struct Worker {
    int rank = 0;
    int64_t step = 0;
    double throughput = 0;
    std::string state;
    double seconds_since_heartbeat = 0;
  };
  Phase phase = Phase::kGathering;
  int64_t generation = 0;
  int world_size = 0;
  int restarts = 0;
  std::vector<Node> nodes;
  std::vector<Worker> workers;  // by rank
  std::string last_failure;
};

// Not thread-safe: the caller serialises every call (the gRPC adapter holds one mutex around
// each, and wakes its blocked Join calls after any call that may have changed the state).
// Calls that take a request's fields throw InvalidArgument, naming them, for values that
// cannot become ranks; they leave the state unchanged then. Nothing else throws.
class Membership {
 public:
  using Clock = std::chrono::steady_clock;
  // `now` is the clock every transition reads (a manual clock in tests).
  explicit Membership(MembershipOptions options,
                      std::function<Clock::time_point()> now = Clock::now);

  // An agent joins (or renews its join to) the next round. Idempotent: agents call it
  // repeatedly while they wait. Node ids are 1 to 1024 bytes, nproc in [1, 4096], hint >= -1
  // (-1: no preference; nodes are ordered by hint, then by id). Closes the round when
  // max_nodes are waiting; starts the last-call timer when min_nodes are.
  JoinResult join(const std::string& node_id, int nproc, int hint);

  // An agent's heartbeat (renews its node in `generation`) and a worker's (records progress).
  // A worker rank outside the current generation's world is InvalidArgument.
  HeartbeatResult node_heartbeat(const std::string& node_id, int64_t generation);
  HeartbeatResult worker_heartbeat(int rank, int64_t generation, int64_t step, double throughput,
                                   const std::string& state);

  // A worker of `generation` failed: the generation ends as a failure (kGathering, or kFailed
  // past max_restarts). Ignored for any other generation or phase.
  void report_failure(int64_t generation, int exit_code, const std::string& reason);
  // An agent's workers all finished: once every member of the running generation left, the
  // job is kFinished. Ignored for any other generation.
  void leave(const std::string& node_id, int64_t generation);
  // An agent stops the job (a signal): kFailed with `exit_code`, unless already over.
  void stop(int exit_code, const std::string& reason);

  // Time-driven transitions: silent nodes and workers end the running generation; waiting
  // agents that went away leave the round; the round closes when its last call is over.
  void tick();

  Phase phase() const { return phase_; }
  int64_t generation() const { return generation_; }
  bool done() const { return phase_ == Phase::kFinished || phase_ == Phase::kFailed; }
  MembershipStatus status() const;
  // One line per phase change since the last call ("generation 2 starts: 2 node(s), world
  // size 4"), for the adapter to log at its level.
  struct Event {
    enum Level { kInfo, kWarn, kError };
    Level level = kInfo;
    std::string text;
  };
  std::vector<Event> take_events();

 private:
  struct Member {
    std::string node_id;
    int node_rank = 0;
    int nproc = 0;
    int rank_offset = 0;
    Clock::time_point last_heartbeat;
    bool left = false;
  };
  struct Waiting {
    int nproc = 0;
    int hint = -1;
    Clock::time_point seen;
  };
  struct Worker {
    int64_t step = 0;
    double throughput = 0;
    std::string state;
    Clock::time_point last_heartbeat;
  };

  void close_round();
  void end_generation(const std::string& reason, int code, bool failure);
  HeartbeatResult heartbeat_result(int64_t generation) const;
  std::optional<JoinResult> over_result() const;

  // Constant after construction.
  const MembershipOptions options_;
  const std::function<Clock::time_point()> now_;

  Phase phase_ = Phase::kGathering;
  int64_t generation_ = 0;  // 0 until the first round closes
  std::map<std::string, Waiting> waiting_;
  std::optional<Clock::time_point> round_deadline_;  // set once min_nodes are waiting
  std::map<std::string, Assignment> assigned_;       // this generation's, by node id
  std::vector<Member> members_;
  std::map<int, Worker> workers_;
  int restarts_ = 0;
  int world_size_ = 0;
  int exit_code_ = 0;
  std::string last_failure_;
  std::vector<Event> events_;
};

}  // namespace loom::control
