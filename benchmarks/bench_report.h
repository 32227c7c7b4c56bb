// Shared output of the benchmark binaries: one Row per measured case, printed as an aligned
// table for people and, with --json, as one JSON object per line with the fields every Loom
// benchmark reports (bench, case, loom, baseline, baseline_name, unit, ratio; ratio > 1 means
// Loom is better) plus any extra numeric fields.
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace loom::bench {

struct Row {
  std::string bench;
  std::string case_name;
  double loom = 0;
  double baseline = 0;
  std::string baseline_name;
  std::string unit;
  double ratio = 0;
  std::map<std::string, double> extra;  // e.g. busbw_loom_gbps
};

inline std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

inline void print_json(const Row& row) {
  std::printf(
      "{\"bench\": \"%s\", \"case\": \"%s\", \"loom\": %.6g, \"baseline\": %.6g, "
      "\"baseline_name\": \"%s\", \"unit\": \"%s\", \"ratio\": %.4f",
      json_escape(row.bench).c_str(), json_escape(row.case_name).c_str(), row.loom, row.baseline,
      json_escape(row.baseline_name).c_str(), json_escape(row.unit).c_str(), row.ratio);
  for (const auto& [key, value] : row.extra) std::printf(", \"%s\": %.6g", key.c_str(), value);
  std::printf("}\n");
  std::fflush(stdout);
}

// "8 B", "4 KiB", "256 MiB".
inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 3) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), bytes == static_cast<int64_t>(bytes) ? "%.0f %s" : "%.1f %s",
                bytes, units[unit]);
  return text;
}

}  // namespace loom::bench
