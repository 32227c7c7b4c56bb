// The commit protocol of one checkpoint step over a Store (see commit.h).
#include "ckpt/commit.h"

#include <algorithm>
#include <thread>

#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/deadline.h"

namespace loom::ckpt {
namespace {

const char* phase_name(StepCommit::Phase phase) {
  switch (phase) {
    case StepCommit::Phase::kOpen:
      return "open";
    case StepCommit::Phase::kReported:
      return "reported";
    case StepCommit::Phase::kCollected:
      return "collected";
    case StepCommit::Phase::kDecided:
      return "decided";
    case StepCommit::Phase::kFinished:
      return "finished";
  }
  return "?";
}

std::string encode(const char* token, const std::string& detail) {
  return std::string(token) + "\n" + detail;
}

// Splits "<token>\n<detail>" and maps the token through `names` (value -> token) back to its
// enum value; any other token is CorruptData naming the key.
template <typename Enum, size_t N>
std::pair<Enum, std::string> decode(const std::string& value, const Enum (&values)[N],
                                    const char* (*name_of)(Enum), const std::string& key) {
  const size_t newline = value.find('\n');
  const std::string token = value.substr(0, newline);
  const std::string detail = newline == std::string::npos ? "" : value.substr(newline + 1);
  for (Enum v : values)
    if (token == name_of(v)) return {v, detail};
  throw CorruptData(detail::concat("checkpoint commit key ", key, " holds \"", token,
                                   "\", which is not a status this protocol writes (is another "
                                   "program using the same Store prefix?)"));
}

constexpr RankStatus kStatuses[] = {RankStatus::kWritten, RankStatus::kFailed,
                                    RankStatus::kSkipped};
constexpr Decision kDecisions[] = {Decision::kCommitted, Decision::kFailed, Decision::kSkipped};

}  // namespace

const char* status_name(RankStatus status) {
  switch (status) {
    case RankStatus::kWritten:
      return "written";
    case RankStatus::kFailed:
      return "failed";
    case RankStatus::kSkipped:
      return "skipped";
  }
  return "?";
}

const char* decision_name(Decision decision) {
  switch (decision) {
    case Decision::kCommitted:
      return "committed";
    case Decision::kFailed:
      return "failed";
    case Decision::kSkipped:
      return "skipped";
  }
  return "?";
}

Verdict tally(const std::vector<RankReport>& reports) {
  for (const RankReport& r : reports)
    if (r.status == RankStatus::kFailed) return {Decision::kFailed, r.detail};
  for (const RankReport& r : reports)
    if (r.status == RankStatus::kSkipped)
      return {Decision::kSkipped, detail::concat("rank ", r.rank, ": ", r.detail)};
  return {Decision::kCommitted, ""};
}

StepCommit::StepCommit(comm::Store& store, std::string prefix, int64_t step, int rank,
                       int world_size)
    : store_(store), prefix_(std::move(prefix)), step_(step), rank_(rank), world_size_(world_size) {
  LOOM_CHECK(world_size > 0 && rank >= 0 && rank < world_size, InvalidArgument,
             "checkpoint commit: rank ", rank, " is not in [0, world_size = ", world_size, ")");
}

std::string StepCommit::key(const std::string& name) const {
  return detail::concat(prefix_, "/", step_, "/", name);
}

void StepCommit::expect(bool allowed, const char* call) const {
  LOOM_CHECK(allowed, InvalidArgument, "checkpoint commit of step ", step_, ": ", call,
             " is not allowed on rank ", rank_, " in phase ", phase_name(phase_));
}

void StepCommit::report(RankStatus status, const std::string& detail) {
  expect(rank_ != 0 && phase_ == Phase::kOpen, "report()");
  store_.set(key(detail::concat("rank_", rank_)), encode(status_name(status), detail));
  phase_ = Phase::kReported;
}

std::string StepCommit::await(const std::string& name, const char* what,
                              Clock::time_point deadline) {
  const Clock::time_point start = Clock::now();
  // Polls (Store::check) rather than one blocking get, so that an abandoned wait ends soon.
  while (!store_.check({name})) {
    LOOM_CHECK(abandon_ == nullptr || !abandon_->load(), Error, "checkpoint commit of step ", step_,
               ": abandoned while waiting for ", what, " (key '", name,
               "'): the Checkpointer's owner is unwinding from a failure");
    if (util::expired(deadline))
      throw Timeout(detail::concat(
          "checkpoint commit of step ", step_, ": timed out after ",
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count(),
          " ms waiting for ", what, " (key '", name, "')"));
    std::this_thread::sleep_for(
        std::min<std::chrono::milliseconds>(util::time_left(deadline), kPoll));
  }
  return store_.get(name, std::chrono::milliseconds(0));
}

Verdict StepCommit::await_decision(Clock::time_point deadline) {
  expect(rank_ != 0 && phase_ == Phase::kReported, "await_decision()");
  const std::string name = key("commit");
  auto [decision, detail] =
      decode(await(name, "rank 0's decision", deadline), kDecisions, decision_name, name);
  phase_ = Phase::kDecided;
  return {decision, std::move(detail)};
}

std::vector<RankReport> StepCommit::await_reports(Clock::time_point deadline) {
  expect(rank_ == 0 && phase_ == Phase::kOpen, "await_reports()");
  std::vector<RankReport> reports;
  try {
    for (int r = 1; r < world_size_; ++r) {
      const std::string name = key(detail::concat("rank_", r));
      const std::string what = detail::concat("rank ", r, "'s report");
      auto [status, detail] =
          decode(await(name, what.c_str(), deadline), kStatuses, status_name, name);
      reports.push_back({r, status, std::move(detail)});
    }
  } catch (const Error& e) {  // a rank that never reported (Timeout): the others fail fast too
    decide(Decision::kFailed, detail::concat("rank 0: ", e.what()));
    throw;
  }
  phase_ = Phase::kCollected;
  return reports;
}

void StepCommit::decide(Decision decision, const std::string& detail) {
  expect(rank_ == 0 && (phase_ == Phase::kOpen || phase_ == Phase::kCollected), "decide()");
  store_.set(key("commit"), encode(decision_name(decision), detail));
  phase_ = Phase::kDecided;
}

void StepCommit::finish() {
  expect(phase_ != Phase::kFinished, "finish()");
  phase_ = Phase::kFinished;
  if (store_.add(key("finished"), 1) < world_size_) return;
  for (int r = 1; r < world_size_; ++r) store_.remove(key(detail::concat("rank_", r)));
  store_.remove(key("commit"));
  store_.remove(key("finished"));
}

}  // namespace loom::ckpt
