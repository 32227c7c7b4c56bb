// A worker's StepReport (proto/loom.proto) as the coordinator's job metrics keep it
// (control/job_metrics.h); shared by the coordinator and its RPC fuzzer.
#pragma once

#include <chrono>
#include <cstdint>

#include "control/job_metrics.h"
#include "loom.pb.h"

namespace loom::control {

inline StepPoint to_step_point(int64_t generation, const v1::StepReport& report, double unix_time) {
  StepPoint p;
  p.unix_time = unix_time;
  p.generation = generation;
  p.steps = report.steps();
  p.last_step = report.last_step();
  p.step_seconds = report.step_seconds();
  p.phase_seconds = {report.phase_seconds().begin(), report.phase_seconds().end()};
  p.tokens_per_second = report.tokens_per_second();
  p.samples_per_second = report.samples_per_second();
  p.mfu = report.mfu();
  p.rss_bytes = report.rss_bytes();
  p.loss = report.loss();
  p.goodput = report.goodput();
  return p;
}

}  // namespace loom::control
