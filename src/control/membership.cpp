// The rendezvous and membership state machine (membership.h): rounds, generations, failures,
// lost nodes and the end of the job, as transitions on plain values.
#include "control/membership.h"

#include <algorithm>
#include <climits>

#include "loom/error.h"

namespace loom::control {
namespace {

// Workers one node may run (the launcher's --nproc-per-node bound).
constexpr int kMaxNproc = 4096;
constexpr size_t kMaxNodeId = 1024;

}  // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kGathering:
      return "gathering";
    case Phase::kRunning:
      return "running";
    case Phase::kFinished:
      return "finished";
    case Phase::kFailed:
      return "failed";
  }
  return "unknown";
}

Membership::Membership(MembershipOptions options, std::function<Clock::time_point()> now)
    : options_(options), now_(std::move(now)) {
  LOOM_CHECK(options_.min_nodes >= 1 && options_.max_nodes >= options_.min_nodes, InvalidArgument,
             "nodes must satisfy 1 <= min <= max, got ", options_.min_nodes, ":",
             options_.max_nodes);
  LOOM_CHECK(options_.max_restarts >= 0, InvalidArgument, "max_restarts must be >= 0");
}

std::optional<JoinResult> Membership::over_result() const {
  if (phase_ == Phase::kFinished) {
    return JoinResult{JoinResult::kJobFinished, {}, 0, "the job already finished"};
  }
  if (phase_ == Phase::kFailed) {
    return JoinResult{JoinResult::kJobFailed, {}, exit_code_, "the job failed: " + last_failure_};
  }
  return std::nullopt;
}

JoinResult Membership::join(const std::string& node_id, int nproc, int hint) {
  // A node's count and hint become ranks and the world size: refuse what cannot be one.
  LOOM_CHECK(!node_id.empty() && node_id.size() <= kMaxNodeId && nproc >= 1 && nproc <= kMaxNproc &&
                 hint >= -1,
             InvalidArgument, "Join from node '", node_id.substr(0, 64), "': nproc ", nproc,
             " must be in [1, ", kMaxNproc, "], node_rank_hint ", hint,
             " >= -1, and the node id 1 to 1024 bytes");
  if (auto over = over_result()) {
    waiting_.erase(node_id);
    return *over;
  }
  const auto admitted = [&]() -> std::optional<JoinResult> {
    auto it = assigned_.find(node_id);
    if (phase_ != Phase::kRunning || it == assigned_.end()) return std::nullopt;
    return JoinResult{JoinResult::kAdmitted, it->second, 0, ""};
  };
  if (auto a = admitted()) return *a;  // the round closed between two of this agent's joins
  waiting_[node_id] = {nproc, hint, now_()};
  const int count = static_cast<int>(waiting_.size());
  if (phase_ == Phase::kGathering && count >= options_.min_nodes) {
    if (count >= options_.max_nodes) {
      close_round();
      if (auto a = admitted()) return *a;
    } else if (!round_deadline_) {
      round_deadline_ = now_() + options_.last_call;
    }
  }
  return JoinResult{
      JoinResult::kWaiting,
      {},
      0,
      detail::concat(waiting_.size(), " node(s) joined, at least ", options_.min_nodes, " needed")};
}

// The waiting agents, ordered by hint (none last), then id, become the next generation; those
// beyond max_nodes keep waiting for the one after.
void Membership::close_round() {
  std::vector<std::pair<std::string, Waiting>> nodes(waiting_.begin(), waiting_.end());
  std::sort(nodes.begin(), nodes.end(), [](const auto& a, const auto& b) {
    const int ha = a.second.hint < 0 ? INT_MAX : a.second.hint;
    const int hb = b.second.hint < 0 ? INT_MAX : b.second.hint;
    return ha != hb ? ha < hb : a.first < b.first;
  });
  if (static_cast<int>(nodes.size()) > options_.max_nodes)
    nodes.resize(static_cast<size_t>(options_.max_nodes));
  ++generation_;
  members_.clear();
  assigned_.clear();
  workers_.clear();
  int offset = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    members_.push_back(
        {nodes[i].first, static_cast<int>(i), nodes[i].second.nproc, offset, now_(), false});
    offset += nodes[i].second.nproc;
  }
  world_size_ = offset;
  for (const Member& m : members_) {
    assigned_[m.node_id] = {generation_,   m.node_rank, static_cast<int>(members_.size()),
                            m.rank_offset, world_size_, restarts_};
    waiting_.erase(m.node_id);
  }
  round_deadline_.reset();
  phase_ = Phase::kRunning;
  events_.push_back(
      {Event::kInfo, detail::concat("generation ", generation_, " starts: ", members_.size(),
                                    " node(s), world size ", world_size_)});
}

void Membership::end_generation(const std::string& reason, int code, bool failure) {
  if (phase_ != Phase::kRunning) return;
  last_failure_ = reason;
  if (failure) {
    ++restarts_;
    if (exit_code_ == 0) exit_code_ = code != 0 ? code : 1;
  }
  if (failure && restarts_ > options_.max_restarts) {
    phase_ = Phase::kFailed;
    events_.push_back({Event::kError, detail::concat("generation ", generation_, " ended: ", reason,
                                                     "; restarts exhausted (",
                                                     options_.max_restarts, "), the job fails")});
  } else {
    phase_ = Phase::kGathering;
    events_.push_back(
        {Event::kWarn, detail::concat("generation ", generation_, " ended: ", reason, "; ",
                                      failure ? detail::concat("restart ", restarts_, " of ",
                                                               options_.max_restarts)
                                              : std::string("re-rendezvous"))});
  }
}

HeartbeatResult Membership::heartbeat_result(int64_t generation) const {
  HeartbeatResult r;
  r.state = phase_ == Phase::kFinished                               ? HeartbeatResult::kFinished
            : phase_ == Phase::kFailed                               ? HeartbeatResult::kFailed
            : generation == generation_ && phase_ == Phase::kRunning ? HeartbeatResult::kRunning
                                                                     : HeartbeatResult::kEnded;
  r.generation = generation_;
  r.exit_code = exit_code_;
  r.reason = last_failure_;
  return r;
}

HeartbeatResult Membership::node_heartbeat(const std::string& node_id, int64_t generation) {
  if (generation == generation_ && phase_ == Phase::kRunning) {
    for (Member& m : members_) {
      if (m.node_id == node_id) m.last_heartbeat = now_();
    }
  }
  return heartbeat_result(generation);
}

HeartbeatResult Membership::worker_heartbeat(int rank, int64_t generation, int64_t step,
                                             double throughput, const std::string& state) {
  LOOM_CHECK(generation != generation_ || (rank >= 0 && rank < world_size_), InvalidArgument,
             "Heartbeat from rank ", rank, " of generation ", generation_, ", whose world size is ",
             world_size_);
  if (generation == generation_ && phase_ == Phase::kRunning) {
    workers_[rank] = {step, throughput, state, now_()};
  }
  return heartbeat_result(generation);
}

void Membership::report_failure(int64_t generation, int exit_code, const std::string& reason) {
  if (generation == generation_) end_generation(reason, exit_code, true);
}

void Membership::leave(const std::string& node_id, int64_t generation) {
  if (generation != generation_ || phase_ != Phase::kRunning) return;
  bool all = true;
  for (Member& m : members_) {
    if (m.node_id == node_id) m.left = true;
    all = all && m.left;
  }
  if (all) {
    phase_ = Phase::kFinished;
    events_.push_back(
        {Event::kInfo, detail::concat("generation ", generation_, " finished; the job is done")});
  }
}

void Membership::stop(int exit_code, const std::string& reason) {
  if (done()) return;
  phase_ = Phase::kFailed;
  exit_code_ = exit_code;
  last_failure_ = reason;
  events_.push_back({Event::kWarn, "the job stops: " + reason});
}

void Membership::tick() {
  const auto now = now_();
  if (phase_ == Phase::kRunning) {
    for (const Member& m : members_) {
      if (!m.left && now - m.last_heartbeat > options_.node_timeout) {
        end_generation(
            detail::concat("node ", m.node_rank, " (", m.node_id, ") lost: no heartbeat for ",
                           options_.node_timeout.count(), " ms"),
            1, false);
        break;
      }
    }
  }
  if (phase_ == Phase::kRunning) {
    for (const auto& [rank, w] : workers_) {
      if (now - w.last_heartbeat > options_.worker_timeout) {
        end_generation(detail::concat("rank ", rank, " missed heartbeats for ",
                                      options_.worker_timeout.count(), " ms (hung or dead)"),
                       1, true);
        break;
      }
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    it = now - it->second.seen > options_.waiting_expiry ? waiting_.erase(it) : std::next(it);
  }
  if (phase_ == Phase::kGathering && round_deadline_ && now >= *round_deadline_ &&
      static_cast<int>(waiting_.size()) >= options_.min_nodes) {
    close_round();
  }
}

MembershipStatus Membership::status() const {
  const auto now = now_();
  const auto since = [&](Clock::time_point t) {
    return std::chrono::duration<double>(now - t).count();
  };
  MembershipStatus s;
  s.phase = phase_;
  s.generation = generation_;
  s.world_size = world_size_;
  s.restarts = restarts_;
  s.last_failure = last_failure_;
  for (const Member& m : members_) {
    s.nodes.push_back({m.node_id, m.node_rank, m.nproc, since(m.last_heartbeat)});
  }
  for (const auto& [rank, w] : workers_) {
    s.workers.push_back({rank, w.step, w.throughput, w.state, since(w.last_heartbeat)});
  }
  return s;
}

std::vector<Membership::Event> Membership::take_events() {
  std::vector<Event> events;
  events.swap(events_);
  return events;
}

}  // namespace loom::control
