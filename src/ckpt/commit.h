// The commit protocol of one checkpoint step: how the ranks that save a step agree, through
// the Store, that every data file is durable before rank 0 writes the manifest, and how a
// failure or a skip on any rank reaches every rank. Private to Loom.
//
// Keys, under <prefix>/<step>/:
//   rank_<r>   rank r's report (r = 1..W-1): kWritten with its part of the manifest, or kFailed
//              or kSkipped with why
//   commit     rank 0's decision: kCommitted once the manifest is durable, or kFailed or kSkipped
//              with why
//   finished   a counter; the rank that brings it to W removes the step's keys
// Values are "<token>\n<detail>", the token naming the enum value; anything else is CorruptData.
//
// One StepCommit per rank and step, moving through its phases (any other order of calls is
// InvalidArgument naming the call and the phase):
//   rank r > 0:  kOpen -report()-> kReported -await_decision()-> kDecided -finish()-> kFinished
//                (a rank whose report is kFailed or kSkipped does not wait: kReported -finish()->)
//   rank 0:      kOpen -await_reports()-> kCollected -decide()-> kDecided -finish()-> kFinished
//                (its own failure or skip decides at once: kOpen -decide()-> kDecided)
// Rank 0 tallies the reports (tally()): a failure wins over a skip, a skip over success; it
// decides kCommitted only after it wrote the manifest. A rank that does not report before the
// deadline fails the step on every rank: await_reports() decides kFailed, naming the key, and
// raises Timeout; so does an abandoned wait (abandon_when), with its Error. Not thread-safe: one
// thread drives one StepCommit.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace loom::comm {
class Store;
}

namespace loom::ckpt {

// What a rank reports about its part of a step.
enum class RankStatus { kWritten, kFailed, kSkipped };
// What rank 0 decides for the step.
enum class Decision { kCommitted, kFailed, kSkipped };

const char* status_name(RankStatus status);
const char* decision_name(Decision decision);

struct RankReport {
  int rank = 0;
  RankStatus status = RankStatus::kWritten;
  std::string detail;  // kWritten: the rank's report (manifest JSON); otherwise why
};

struct Verdict {
  Decision decision = Decision::kCommitted;
  std::string detail;  // why, for kFailed and kSkipped
};

// The decision the reports call for, before rank 0 writes the manifest: kFailed with the first
// failure's detail if any rank failed, else kSkipped with "rank <r>: <why>" of the first skip,
// else kCommitted.
Verdict tally(const std::vector<RankReport>& reports);

class StepCommit {
 public:
  enum class Phase { kOpen, kReported, kCollected, kDecided, kFinished };
  using Clock = std::chrono::steady_clock;

  // The Store must outlive this object.
  StepCommit(comm::Store& store, std::string prefix, int64_t step, int rank, int world_size);

  // Ranks 1..W-1: publishes this rank's report.
  void report(RankStatus status, const std::string& detail);
  // Ranks 1..W-1, after a kWritten report: waits for rank 0's decision. Timeout names the key.
  Verdict await_decision(Clock::time_point deadline);

  // Rank 0: the reports of ranks 1..W-1, in rank order. A rank missing at the deadline decides
  // kFailed ("rank 0: <the Timeout's message>") and raises that Timeout.
  std::vector<RankReport> await_reports(Clock::time_point deadline);
  // Rank 0: announces the decision to every rank.
  void decide(Decision decision, const std::string& detail = "");

  // Every rank, last, whatever happened before: the last rank to finish removes the keys.
  void finish();

  // From now on the waits above give up, within kPoll, once `flag` is true (raising Error
  // "... abandoned ..."), instead of waiting out their deadline: the Checkpointer sets it when
  // its owner unwinds from a failure, which a dead peer's report would never end. The flag must
  // outlive this object.
  void abandon_when(const std::atomic<bool>& flag) { abandon_ = &flag; }
  static constexpr std::chrono::milliseconds kPoll{50};

  Phase phase() const { return phase_; }
  int64_t step() const { return step_; }
  // "<prefix>/<step>/<name>".
  std::string key(const std::string& name) const;

 private:
  void expect(bool allowed, const char* call) const;
  // The value of key `name`, waiting for it until the deadline (Timeout naming the key and
  // `what` it is) or until abandoned.
  std::string await(const std::string& name, const char* what, Clock::time_point deadline);

  // Constant after construction.
  comm::Store& store_;
  const std::string prefix_;
  const int64_t step_;
  const int rank_;
  const int world_size_;

  Phase phase_ = Phase::kOpen;
  const std::atomic<bool>* abandon_ = nullptr;
};

}  // namespace loom::ckpt
