// `loom top`'s table from the coordinator's /api/metrics JSON (and the job spec's services).
#include "top_view.h"

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "loom/error.h"

namespace loom::cli {
namespace {

using nlohmann::json;

std::string percent(const json& v) {
  return v.is_number() ? fmt::format("{:.1f}%", 100 * v.get<double>()) : "-";
}

double phase(const json& point, const char* name) {
  const json& phases = point.at("phase_seconds");
  return phases.contains(name) ? phases.at(name).get<double>() : 0.0;
}

}  // namespace

std::string render_top(const std::string& api_metrics_json) {
  const json j = json::parse(api_metrics_json, nullptr, /*allow_exceptions=*/false);
  LOOM_CHECK(j.is_object() && j.contains("job") && j.contains("summary") && j.contains("ranks") &&
                 j.contains("stragglers"),
             InvalidArgument,
             "not the coordinator's /api/metrics answer (no job, summary, ranks and stragglers): ",
             api_metrics_json.substr(0, 200));
  try {
    const json& job = j.at("job");
    const int64_t generation = job.at("generation").get<int64_t>();
    std::map<int, std::string> flagged;
    for (const json& s : j.at("stragglers")) {
      flagged[s.at("rank").get<int>()] = fmt::format(
          "straggler: rank {}, {:.2f}x the other ranks' time outside collective waits, most in {} "
          "(+{:.3f} s)",
          s.at("rank").get<int>(), s.at("ratio").get<double>(), s.at("phase").get<std::string>(),
          s.at("phase_excess_seconds").get<double>());
    }
    // Each rank's newest report in the current generation.
    std::vector<std::pair<int, const json*>> rows;
    for (const json& r : j.at("ranks")) {
      const json& series = r.at("series");
      if (series.empty() || series.back().at("generation").get<int64_t>() != generation) continue;
      rows.emplace_back(r.at("rank").get<int>(), &series.back());
    }
    std::string out = fmt::format("generation {} {}, world {}, restarts {}", generation,
                                  job.at("state").get<std::string>(),
                                  job.at("world_size").get<int>(), job.at("restarts").get<int>());
    // The job's figures as the coordinator sums them (JobMetrics::summary).
    const json& summary = j.at("summary");
    if (summary.at("ranks").get<int>() > 0) {
      out += fmt::format(" | {:.0f} tokens/s | step {:.3f} s | MFU {}",
                         summary.at("tokens_per_second").get<double>(),
                         summary.at("step_seconds").get<double>(), percent(summary.at("mfu")));
      if (!summary.at("goodput").is_null()) {
        const json& loss = summary.at("loss");  // null: not finite
        out += fmt::format(" | goodput {} | loss {}", percent(summary.at("goodput")),
                           loss.is_number() ? fmt::format("{:.4f}", loss.get<double>()) : "-");
      }
    }
    if (job.contains("hang") && !job.at("hang").get<std::string>().empty())
      out += "\nHUNG: " + job.at("hang").get<std::string>();
    if (!job.at("last_failure").get<std::string>().empty())
      out += "\nlast failure: " + job.at("last_failure").get<std::string>();
    out += "\n";
    std::string services;  // the job spec's services, when it has any
    if (j.contains("services") && !j.at("services").empty()) {
      services = fmt::format("{:<16} {:>4} {:<12} {:>8} {:>8}  {}\n", "service", "node", "state",
                             "pid", "restarts", "last exit");
      for (const json& e : j.at("services")) {
        services += fmt::format(
            "{:<16} {:>4} {:<12} {:>8} {:>8}  {}\n",
            e.at("service").get<std::string>() + "/" + std::to_string(e.at("replica").get<int>()),
            e.at("node").get<int>(), e.at("state").get<std::string>(), e.at("pid").get<int>(),
            e.at("restarts").get<int>(), e.at("last_exit").get<std::string>());
      }
    }
    if (rows.empty()) return out + "no step reported in this generation yet\n" + services;
    out += fmt::format("{:>4} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>10} {:>6} {:>8}\n",
                       "rank", "step", "step_s", "busy_s", "data", "fwd_bwd", "comm", "optim",
                       "ckpt", "tokens/s", "mfu", "rss_MiB");
    for (const auto& [rank, p] : rows) {
      out += fmt::format(
          "{:>4} {:>8} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>10.0f} "
          "{:>6} {:>8.1f}{}\n",
          rank, p->at("last_step").get<int64_t>(), p->at("step_seconds").get<double>(),
          p->at("busy_seconds").get<double>(), phase(*p, "data_wait"),
          phase(*p, "forward_backward"), phase(*p, "comm_wait"), phase(*p, "optimizer"),
          phase(*p, "checkpoint_stall"), p->at("tokens_per_second").get<double>(),
          percent(p->at("mfu")), static_cast<double>(p->at("rss_bytes").get<int64_t>()) / (1 << 20),
          flagged.count(rank) ? "  << straggler" : "");
    }
    for (const auto& [rank, line] : flagged) out += line + "\n";
    return out + services;
  } catch (const json::exception& e) {
    throw InvalidArgument(
        detail::concat("the coordinator's /api/metrics answer lacks a field: ", e.what()));
  }
}

}  // namespace loom::cli
