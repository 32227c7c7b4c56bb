// The job dashboard (`loom dash`): one HTML page with its script and styles inline (no CDN,
// nothing fetched from elsewhere), drawn in the browser from /api/metrics, plus links to the
// run's traces and flight dumps. The coordinator serves it beside /metrics for a running job;
// `loom dash RUN_DIR` serves it for a finished one from <run_dir>/job_metrics.json
// (docs/observability.md). Both use these routes.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

namespace httplib {
class Server;
}

namespace loom::control {

struct DashboardSource {
  // The body of /api/metrics (JobMetrics::json's format); may throw loom::Error, which the
  // route answers with 503 and the message.
  std::function<std::string()> metrics_json;
  // traces/, flight/ and stacks/ below it are listed at /api/files and served at
  // /files/...; empty: none.
  std::filesystem::path run_dir;
};

// GET /: the page; /api/metrics; /api/files: {"traces": [...], "flight": [...], "stacks":
// [...]}, each entry
// {"path": "traces/job.json", "bytes": N}; /files/<path>: one of those files, and nothing else
// (any other path is 404).
void add_dashboard_routes(httplib::Server& server, DashboardSource source);

// The page itself.
const char* dashboard_page();

}  // namespace loom::control
