// The trace recorder and StepTracer (loom/metrics/trace.h).
#include "loom/metrics/trace.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string_view>

#include "comm/group_internal.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/runtime.h"
#include "loom/version.h"
#include "metrics/trace_internal.h"
#include "util/files.h"
#include "util/number.h"

namespace loom::metrics {
namespace {

using nlohmann::json;

// A recorded span. Arguments stay text until the file is written.
struct Event {
  const char* category;
  std::string name;
  int64_t start_us;
  int64_t end_us;
  int tid;
  std::string args;
};

// More spans than this between flushes are dropped and counted (a StepTracer given many steps
// of a model with many collectives); each takes about 150 bytes.
constexpr size_t kMaxEvents = 1'000'000;

// The process's one recorder. `on` is what every recording site reads.
struct Recorder {
  std::atomic<bool> on{false};
  std::atomic<bool> armed{false};  // a recording StepTracer exists: trace_span keeps spans
  std::atomic<int64_t> step{-1};
  std::mutex mutex;
  // State below is protected by mutex.
  std::vector<Event> events;
  uint64_t dropped = 0;
  std::map<int, std::string> thread_names;  // every tid that recorded, with its name then
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: threads may record during exit
  return *r;
}

int this_tid() {
  thread_local const int tid = static_cast<int>(::syscall(SYS_gettid));
  return tid;
}

std::string this_thread_name() {
  char name[16] = {};
  if (::pthread_getname_np(::pthread_self(), name, sizeof(name)) != 0) return "";
  return name;
}

int64_t parse_step(const std::string& spec, const std::string& text) {
  const std::optional<uint64_t> value = util::parse_unsigned(text);
  if (!value || *value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    throw ConfigError(detail::concat(
        "metrics.trace_steps: '", spec, "' is not a list of steps: '", text,
        "' is not a step (0-based step indices or ranges, e.g. \"10\", \"10-12\", \"3,10-12\")"));
  }
  return static_cast<int64_t>(*value);
}

}  // namespace

std::vector<int64_t> parse_trace_steps(const std::string& spec) {
  std::set<int64_t> steps;
  size_t begin = 0;
  while (begin < spec.size()) {
    size_t end = spec.find(',', begin);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(begin, end - begin);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    const size_t dash = item.find('-', 1);
    const int64_t first = parse_step(spec, dash == std::string::npos ? item : item.substr(0, dash));
    const int64_t last =
        dash == std::string::npos ? first : parse_step(spec, item.substr(dash + 1));
    if (last < first || last - first >= 100'000) {
      throw ConfigError(detail::concat("metrics.trace_steps: the range '", item, "' in '", spec,
                                       "' is ", last < first ? "empty" : "over 100000 steps",
                                       " (write FIRST-LAST with FIRST <= LAST)"));
    }
    for (int64_t s = first; s <= last; ++s) steps.insert(s);
    begin = end + 1;
    if (end + 1 == spec.size()) {
      throw ConfigError(detail::concat("metrics.trace_steps: '", spec, "' ends with a comma"));
    }
  }
  return {steps.begin(), steps.end()};
}

bool tracing() { return recorder().on.load(std::memory_order_relaxed); }

int64_t trace_now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void trace_span(const char* category, std::string name, int64_t start_us, int64_t end_us,
                std::string args_json) {
  Recorder& r = recorder();
  if (!r.armed.load(std::memory_order_relaxed)) return;
  const int tid = this_tid();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.events.size() >= kMaxEvents) {
    ++r.dropped;
    return;
  }
  if (r.thread_names.count(tid) == 0) r.thread_names[tid] = this_thread_name();
  r.events.push_back(Event{category, std::move(name), start_us, std::max(start_us, end_us), tid,
                           std::move(args_json)});
}

TraceSpan::TraceSpan(const char* category, const char* name) : category_(category), name_(name) {
  if (tracing()) start_us_ = trace_now_us();
}

TraceSpan::~TraceSpan() {
  if (start_us_ >= 0) trace_span(category_, name_, start_us_, trace_now_us(), std::move(args_));
}

void TraceSpan::args(std::string args_json) {
  if (start_us_ >= 0) args_ = std::move(args_json);
}

namespace internal {

int64_t traced_step() { return recorder().step.load(std::memory_order_relaxed); }

ClockOffset measure_clock_offset(comm::Store& store, const std::string& prefix, int rank, int size,
                                 int rounds, std::chrono::milliseconds timeout) {
  const auto key = [&](const char* what, int r, int k) {
    return detail::concat(prefix, "/", what, "/", r, "/", k);
  };
  if (rank == 0) {
    // Rank 0 answers each ping with its clock, as soon as it sees it.
    for (int k = 0; k < rounds; ++k) {
      for (int r = 1; r < size; ++r) {
        store.get(key("ping", r, k), timeout);
        store.set(key("pong", r, k), std::to_string(trace_now_us()));
      }
    }
    return {};
  }
  ClockOffset best{0, std::numeric_limits<double>::infinity()};
  for (int k = 0; k < rounds; ++k) {
    const int64_t sent = trace_now_us();
    store.set(key("ping", rank, k), "");
    const int64_t theirs = std::stoll(store.get(key("pong", rank, k), timeout));
    const int64_t received = trace_now_us();
    const double half_trip = static_cast<double>(received - sent) / 2;
    if (half_trip < best.uncertainty_us) {
      best = {static_cast<double>(theirs) - (static_cast<double>(sent) + half_trip), half_trip};
    }
  }
  return best;
}

}  // namespace internal

struct StepTracer::Impl {
  std::vector<int64_t> steps;
  std::set<int64_t> chosen;
  std::filesystem::path file;
  int rank = 0;
  int world_size = 1;
  ClockOffset clock;
  spdlog::logger* log = nullptr;
  std::string spans_text;  // every span flushed so far, each as ",{...}"
  uint64_t dropped = 0;    // the recorder's count at the last flush
  bool unwritten = false;  // spans_text holds spans the file does not (a write failed)
};

namespace {
std::atomic<bool> g_tracer_exists{false};
}

StepTracer::StepTracer(Runtime& rt, std::vector<int64_t> steps) : impl_(std::make_unique<Impl>()) {
  impl_->steps = std::move(steps);
  impl_->chosen.insert(impl_->steps.begin(), impl_->steps.end());
  impl_->rank = rt.rank();
  impl_->world_size = rt.world_size();
  impl_->file = rt.run_dir() / "traces" / ("rank_" + std::to_string(rt.rank()) + ".json");
  impl_->log = &rt.log();
  if (impl_->steps.empty()) return;
  LOOM_CHECK(!g_tracer_exists.exchange(true), InvalidArgument,
             "StepTracer: another StepTracer records in this process; tracing is per process "
             "(ranks run as threads in one process cannot each trace)");
  try {
    const std::string prefix =
        comm::internal::fresh_store_prefix(rt.store(), "loom/trace_clock", rt.rank());
    impl_->clock = internal::measure_clock_offset(rt.store(), prefix, rt.rank(), rt.world_size(),
                                                  /*rounds=*/8, std::chrono::minutes(2));
  } catch (...) {
    g_tracer_exists = false;
    throw;
  }
  Recorder& r = recorder();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.events.clear();
    r.dropped = 0;
    r.thread_names.clear();
  }
  r.armed = true;
}

StepTracer::~StepTracer() {
  if (impl_->steps.empty()) return;
  Recorder& r = recorder();
  r.on = false;
  try {
    flush();
  } catch (const std::exception& e) {
    impl_->log->error("trace: {}", e.what());
  }
  r.armed = false;
  r.step = -1;
  g_tracer_exists = false;
}

void StepTracer::begin_step(int64_t step) {
  if (impl_->steps.empty()) return;
  Recorder& r = recorder();
  r.step.store(step, std::memory_order_relaxed);
  const bool chosen = impl_->chosen.count(step) != 0;
  const bool was = r.on.exchange(chosen, std::memory_order_relaxed);
  if (!was || chosen) return;
  // A trace is a diagnosis: failing to write it must not stop the training.
  try {
    flush();
  } catch (const std::exception& e) {
    impl_->log->error("trace: {} (training goes on)", e.what());
  }
}

void StepTracer::flush() {
  if (impl_->steps.empty()) return;
  Recorder& r = recorder();
  // The spans recorded since the last flush leave the recorder at once; they are serialized
  // outside the lock and appended to the text of the earlier ones, so a flush costs the new
  // spans and one write of the file.
  std::vector<Event> fresh;
  std::map<int, std::string> thread_names;
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.events.empty() && r.dropped == impl_->dropped && !impl_->unwritten) return;
    fresh.swap(r.events);
    thread_names = r.thread_names;
    dropped = r.dropped;
  }
  const int pid = impl_->rank;
  std::string& spans = impl_->spans_text;
  for (const Event& e : fresh) {
    json event = {{"name", e.name},
                  {"cat", e.category},
                  {"ph", "X"},
                  {"ts", e.start_us},
                  {"dur", e.end_us - e.start_us},
                  {"pid", pid},
                  {"tid", e.tid}};
    if (!e.args.empty()) {
      // A program's own args that are not a JSON object are kept as text, not lost.
      json args = json::parse(e.args, nullptr, /*allow_exceptions=*/false);
      event["args"] = args.is_object() ? std::move(args) : json{{"text", e.args}};
    }
    spans += ',';
    spans += event.dump();
  }
  impl_->dropped = dropped;
  impl_->unwritten = true;
  json metadata = json::array();
  metadata.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"name", detail::concat("rank ", pid)}}}});
  metadata.push_back({{"name", "process_sort_index"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"sort_index", pid}}}});
  for (const auto& [tid, name] : thread_names) {
    metadata.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", tid},
                        {"args", {{"name", name.empty() ? std::to_string(tid) : name}}}});
  }
  const json other = {{"format", "loom.trace"},
                      {"version", 1},
                      {"loom_version", loom::version()},
                      {"rank", impl_->rank},
                      {"world_size", impl_->world_size},
                      {"steps", impl_->steps},
                      {"clock_offset_us", impl_->clock.offset_us},
                      {"clock_uncertainty_us", impl_->clock.uncertainty_us},
                      {"dropped_spans", dropped}};
  std::string text = metadata.dump();  // "[...]": the spans go before its closing bracket
  text.pop_back();
  text = "{\"traceEvents\":" + text + spans +
         "],\"displayTimeUnit\":\"ms\",\"otherData\":" + other.dump() + "}";
  std::error_code ec;
  std::filesystem::create_directories(impl_->file.parent_path(), ec);
  LOOM_CHECK(!ec, IoError, "cannot create the trace directory ", impl_->file.parent_path().string(),
             ": ", ec.message());
  util::write_file_atomic(impl_->file, text, util::Durability::kAtomicOnly);
  impl_->unwritten = false;
}

const std::vector<int64_t>& StepTracer::steps() const { return impl_->steps; }
const std::filesystem::path& StepTracer::file() const { return impl_->file; }
const ClockOffset& StepTracer::clock() const { return impl_->clock; }

}  // namespace loom::metrics
