// `loom top`'s view: the coordinator's job metrics (/api/metrics, control/job_metrics.h)
// rendered as a table: the job's line, one row per rank of the current generation from its
// newest report, and the stragglers. A library of its own so that its unit test
// (tests/unit/cli/) links it without the rest of the tool.
#pragma once

#include <string>

namespace loom::cli {

// The text `loom top` prints for one /api/metrics answer. A body that is not the JSON the
// coordinator serves is InvalidArgument naming what is missing.
std::string render_top(const std::string& api_metrics_json);

}  // namespace loom::cli
