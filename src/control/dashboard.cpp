// The job dashboard's routes (dashboard.h); the page is dashboard_page.cpp.
#include "control/dashboard.h"

#include <httplib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "loom/error.h"

namespace loom::control {
namespace {

namespace fs = std::filesystem;

// A plain file or directory name: no separators, no "..", not hidden.
bool plain(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name[0] != '.' &&
         std::all_of(name.begin(), name.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '_' || c == '-' || c == '.';
         });
}

// The files the dashboard links: *.json directly in traces/, and in flight/ and its
// subdirectories (one level: flight/control/rank_0.json, flight/sub_0_1/rank_0.json); *.txt
// directly in stacks/.
std::vector<std::pair<std::string, uintmax_t>> listed(const fs::path& run_dir,
                                                      const std::string& area) {
  std::vector<std::pair<std::string, uintmax_t>> out;
  if (run_dir.empty()) return out;
  std::error_code ec;
  const std::string extension = area == "stacks" ? ".txt" : ".json";
  auto add_dir = [&](const fs::path& dir, const std::string& prefix, bool recurse) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (!plain(name)) continue;
      if (entry.is_regular_file(ec) && entry.path().extension() == extension) {
        out.emplace_back(prefix + name, entry.file_size(ec));
      } else if (recurse && entry.is_directory(ec)) {
        for (const auto& sub : fs::directory_iterator(entry.path(), ec)) {
          const std::string sub_name = sub.path().filename().string();
          if (plain(sub_name) && sub.is_regular_file(ec) && sub.path().extension() == extension) {
            out.emplace_back(prefix + name + "/" + sub_name, sub.file_size(ec));
          }
        }
      }
    }
  };
  add_dir(run_dir / area, area + "/", area == "flight");
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

void add_dashboard_routes(httplib::Server& server, DashboardSource source) {
  auto shared = std::make_shared<DashboardSource>(std::move(source));
  server.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(dashboard_page(), "text/html; charset=utf-8");
  });
  server.Get("/api/metrics", [shared](const httplib::Request&, httplib::Response& res) {
    try {
      res.set_content(shared->metrics_json(), "application/json");
    } catch (const Error& e) {
      res.status = 503;
      res.set_content(std::string(e.what()) + "\n", "text/plain");
    }
  });
  server.Get("/api/files", [shared](const httplib::Request&, httplib::Response& res) {
    nlohmann::json files = nlohmann::json::object();
    for (const char* area : {"traces", "flight", "stacks"}) {
      nlohmann::json list = nlohmann::json::array();
      for (const auto& [path, bytes] : listed(shared->run_dir, area)) {
        list.push_back({{"path", path}, {"bytes", bytes}});
      }
      files[area] = std::move(list);
    }
    res.set_content(files.dump(), "application/json");
  });
  // Only a file /api/files lists is served: the path must be one of them, byte for byte.
  server.Get(R"(/files/(.+))", [shared](const httplib::Request& req, httplib::Response& res) {
    const std::string wanted = req.matches[1];
    const std::string area = wanted.substr(0, wanted.find('/'));
    bool found = false;
    if (area == "traces" || area == "flight" || area == "stacks") {
      for (const auto& [path, bytes] : listed(shared->run_dir, area)) found |= path == wanted;
    }
    std::ifstream in(shared->run_dir / wanted, std::ios::binary);
    if (!found || !in) {
      res.status = 404;
      res.set_content("not a trace or flight dump of this run\n", "text/plain");
      return;
    }
    std::ostringstream text;
    text << in.rdbuf();
    res.set_content(text.str(),
                    area == "stacks" ? "text/plain; charset=utf-8" : "application/json");
    res.set_header("Content-Disposition",
                   "attachment; filename=\"" + wanted.substr(wanted.rfind('/') + 1) + "\"");
  });
}

}  // namespace loom::control
