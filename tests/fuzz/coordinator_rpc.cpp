// The coordinator's RPC messages as its handlers take them: a sequence of requests, each a
// protobuf message of the type its first byte picks (Join, a node's or a worker's Heartbeat,
// ReportFailure, Leave, GetStatus), parsed from the bytes that follow and handed to the
// membership state machine the way src/control/coordinator.cpp does, on a manual clock that
// each request moves on. Only InvalidArgument may refuse a request (the handlers answer it
// as INVALID_ARGUMENT); the state must stay consistent whatever the order. A worker's step
// report and activity go through the same checks and into the job metrics, whose hang
// watchdog runs and whose Prometheus and JSON renderings are produced after every request.
//
// Input: records of [kind byte][length byte][length bytes of the message].
#include <chrono>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "control/job_metrics.h"
#include "control/membership.h"
#include "control/step_report.h"
#include "fuzz.h"
#include "loom.pb.h"

namespace {

using loom::control::Membership;
namespace v1 = loom::control::v1;

void check_consistent(const Membership& m) {
  const loom::control::MembershipStatus s = m.status();
  if (s.phase == loom::control::Phase::kRunning) {
    int world = 0;
    for (const auto& node : s.nodes) world += node.nproc;
    if (world != s.world_size) __builtin_trap();
    for (const auto& w : s.workers) {
      if (w.rank < 0 || w.rank >= s.world_size) __builtin_trap();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Membership::Clock::time_point now{};
  Membership m({.min_nodes = 1,
                .max_nodes = 2,
                .last_call = std::chrono::seconds(1),
                .max_restarts = 2,
                .node_timeout = std::chrono::seconds(5),
                .worker_timeout = std::chrono::seconds(5),
                .waiting_expiry = std::chrono::seconds(3)},
               [&now] { return now; });
  loom::control::JobMetrics metrics(
      {.history = 8, .straggler_window = 2, .hang_factor = 10, .hang_min_seconds = 1});
  size_t at = 0;
  while (at + 2 <= size) {
    const uint8_t kind = data[at];
    const size_t length = std::min<size_t>(data[at + 1], size - at - 2);
    const void* message = data + at + 2;
    at += 2 + length;
    now += std::chrono::milliseconds(100 * (kind >> 3));  // up to 3.1 s per request
    try {
      switch (kind & 7) {
        case 0: {
          v1::JoinRequest r;
          if (!r.ParseFromArray(message, static_cast<int>(length))) break;
          (void)m.join(r.node_id(), r.nproc(), r.node_rank_hint());
          break;
        }
        case 1:
        case 2: {
          v1::HeartbeatRequest r;
          if (!r.ParseFromArray(message, static_cast<int>(length))) break;
          if (r.rank() >= 0) {
            const double unix_now = std::chrono::duration<double>(now.time_since_epoch()).count();
            const loom::control::RankActivity activity{
                .step = r.step(), .phase = r.phase(), .collective = r.collective()};
            activity.check();
            std::optional<loom::control::StepPoint> point;
            if (r.has_report() && r.report().steps() > 0) {
              point = loom::control::to_step_point(r.generation(), r.report(), unix_now);
              point->check();
            }
            const auto result =
                m.worker_heartbeat(r.rank(), r.generation(), r.step(), r.throughput(), r.state());
            if (result.state == loom::control::HeartbeatResult::kRunning) {
              metrics.observe(r.rank(), r.generation(), activity, unix_now);
              if (point) metrics.record(r.rank(), std::move(*point));
            }
          } else {
            (void)m.node_heartbeat(r.node_id(), r.generation());
          }
          break;
        }
        case 3: {
          v1::FailureRequest r;
          if (!r.ParseFromArray(message, static_cast<int>(length))) break;
          m.report_failure(r.generation(), r.exit_code(), r.reason());
          break;
        }
        case 4: {
          v1::LeaveRequest r;
          if (!r.ParseFromArray(message, static_cast<int>(length))) break;
          if (r.success()) {
            m.leave(r.node_id(), r.generation());
          } else {
            m.stop(r.exit_code(), r.reason());
          }
          break;
        }
        default:
          (void)m.status();
          break;
      }
    } catch (const loom::InvalidArgument&) {
    }
    m.tick();
    (void)m.take_events();
    (void)metrics.check_hang(std::chrono::duration<double>(now.time_since_epoch()).count());
    (void)metrics.take_events();
    check_consistent(m);
    // Both renderings of whatever was accepted: the JSON must parse, every exposition line
    // must be a comment or "name[{labels}] value".
    const loom::control::MembershipStatus status = m.status();
    if (nlohmann::json::parse(metrics.json(status), nullptr, false).is_discarded())
      __builtin_trap();
    const std::string text = metrics.prometheus(status);
    size_t line = 0;
    while (line < text.size()) {
      const size_t end = text.find('\n', line);
      if (end == std::string::npos) __builtin_trap();
      if (text[line] != '#' && text.find(' ', line) >= end) __builtin_trap();
      line = end + 1;
    }
  }
  return 0;
}
