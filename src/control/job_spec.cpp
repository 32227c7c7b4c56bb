// Job specs: parsing and checks (loom/control/job_spec.h).
#include "loom/control/job_spec.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include "config_toml.h"
#include "control/service_keys.h"
#include "loom/error.h"

namespace loom::control {
namespace {

using detail::concat;

// Where a node is: "job.toml:12".
std::string at(const std::filesystem::path& file, const toml::node& node) {
  const auto line = node.source().begin.line;
  return line > 0 ? concat(file.string(), ":", line) : file.string();
}

// Reads one table's keys, each at most once, and reports the first unknown one.
class Reader {
 public:
  Reader(const std::filesystem::path& file, const toml::table& table, std::string prefix)
      : file_(file), table_(table), prefix_(std::move(prefix)) {}

  const toml::node* get(const std::string& key) {
    seen_.insert(key);
    return table_.get(key);
  }

  [[noreturn]] void fail(const toml::node& node, const std::string& key,
                         const std::string& what) const {
    throw ConfigError(concat(at(file_, node), ": ", prefix_, key, ": ", what));
  }

  std::string string(const std::string& key, const std::string& fallback) {
    const toml::node* node = get(key);
    if (node == nullptr) return fallback;
    if (!node->is_string()) fail(*node, key, "must be a string");
    return std::string(node->as_string()->get());
  }

  int64_t integer(const std::string& key, int64_t fallback, int64_t min,
                  int64_t max = std::numeric_limits<int>::max()) {
    const toml::node* node = get(key);
    if (node == nullptr) return fallback;
    if (!node->is_integer()) fail(*node, key, "must be an integer");
    const int64_t value = node->as_integer()->get();
    if (value < min || value > max)
      fail(*node, key, concat("is ", value, "; it must be in [", min, ", ", max, "]"));
    return value;
  }

  double number(const std::string& key, double fallback) {
    const toml::node* node = get(key);
    if (node == nullptr) return fallback;
    if (!node->is_number()) fail(*node, key, "must be a number");
    const double value = node->value<double>().value_or(0);
    if (value < 0) fail(*node, key, concat("is ", value, "; it must not be negative"));
    return value;
  }

  std::vector<std::string> strings(const std::string& key) {
    const toml::node* node = get(key);
    std::vector<std::string> out;
    if (node == nullptr) return out;
    if (!node->is_array()) fail(*node, key, "must be an array of strings");
    for (const toml::node& item : *node->as_array()) {
      if (!item.is_string()) fail(item, key, "must be an array of strings");
      out.emplace_back(item.as_string()->get());
    }
    return out;
  }

  // The first key that was never asked for.
  void check_unknown(const std::string& allowed) const {
    for (const auto& [name, node] : table_) {
      if (seen_.count(std::string(name.str())) == 0) {
        fail(node, std::string(name.str()), "unknown key; the keys here are " + allowed);
      }
    }
  }

  const std::filesystem::path& file() const { return file_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const std::filesystem::path& file_;
  const toml::table& table_;
  std::string prefix_;
  std::set<std::string> seen_;
};

template <typename Enum>
Enum choice(Reader& r, const std::string& key, Enum fallback,
            const std::vector<std::pair<const char*, Enum>>& choices) {
  const toml::node* node = r.get(key);
  if (node == nullptr) return fallback;
  std::string names;
  for (const auto& [name, value] : choices)
    names += (names.empty() ? "" : ", ") + std::string(name);
  if (!node->is_string()) r.fail(*node, key, "must be one of " + names);
  const std::string text(node->as_string()->get());
  for (const auto& [name, value] : choices) {
    if (text == name) return value;
  }
  r.fail(*node, key, concat("is \"", text, "\"; use one of ", names));
}

Placement parse_placement(Reader& r, int64_t replicas) {
  const toml::node* node = r.get("placement");
  Placement p;
  p.replicas = static_cast<int>(replicas);
  if (node == nullptr) return p;
  if (!node->is_string()) r.fail(*node, "placement", "must be a string");
  const std::string text(node->as_string()->get());
  if (text == "every-node") return p;
  if (text == "spread") {
    p.kind = Placement::Kind::kSpread;
    return p;
  }
  if (text.rfind("node:", 0) == 0) {
    try {
      size_t used = 0;
      p.node = std::stoi(text.substr(5), &used);
      if (used == text.size() - 5 && p.node >= 0) {
        p.kind = Placement::Kind::kNode;
        return p;
      }
    } catch (const std::exception&) {
    }
  }
  r.fail(*node, "placement",
         concat("is \"", text, "\"; use \"every-node\", \"node:N\" or \"spread\""));
}

Health parse_health(Reader& r) {
  const toml::node* node = r.get("health");
  Health h;
  if (node == nullptr) return h;
  if (!node->is_table())
    r.fail(*node, "health",
           "must be a table: { tcp = PORT }, "
           "{ http = \"/path\", port = PORT } or "
           "{ heartbeat = true }");
  Reader inner(r.file(), *node->as_table(), r.prefix() + "health.");
  const int64_t tcp = inner.integer("tcp", 0, 1, 65535);
  const std::string http = inner.string("http", "");
  const int64_t port = inner.integer("port", 0, 1, 65535);
  const toml::node* beat = inner.get("heartbeat");
  inner.check_unknown("tcp, http, port and heartbeat");
  const int kinds = (tcp > 0) + !http.empty() + (beat != nullptr);
  if (kinds != 1) r.fail(*node, "health", "needs exactly one of tcp, http and heartbeat");
  if (tcp > 0) {
    h.kind = Health::Kind::kTcp;
    h.port = static_cast<int>(tcp);
  } else if (!http.empty()) {
    if (port == 0) r.fail(*node, "health", "http needs a port");
    h.kind = Health::Kind::kHttp;
    h.port = static_cast<int>(port);
    h.path = http;
  } else {
    if (!beat->is_boolean() || !beat->as_boolean()->get())
      r.fail(*beat, "health.heartbeat", "must be true (or leave health out)");
    h.kind = Health::Kind::kHeartbeat;
  }
  return h;
}

GroupSpec parse_group(const std::filesystem::path& file, const std::string& name,
                      const toml::node& node) {
  const std::string prefix = "group." + name + ".";
  if (!node.is_table()) {
    throw ConfigError(
        concat(at(file, node), ": group.", name, ": must be a table ([group.", name, "])"));
  }
  Reader r(file, *node.as_table(), prefix);
  GroupSpec g;
  g.name = name;
  g.line = static_cast<int>(node.source().begin.line);
  const std::string kind = r.string("kind", "service");
  if (kind != "training" && kind != "service") {
    r.fail(*r.get("kind"), "kind", concat("is \"", kind, "\"; use \"training\" or \"service\""));
  }
  g.training = kind == "training";
  g.command = r.strings("command");
  if (g.command.empty()) {
    throw ConfigError(concat(at(file, node), ": ", prefix,
                             "command: missing; give the program and its arguments as an array "
                             "of strings"));
  }
  g.procs_per_node = static_cast<int>(r.integer("procs_per_node", 1, 1));
  const int64_t replicas = r.integer("replicas", 1, 1);
  g.placement = parse_placement(r, replicas);
  g.restart = choice(r, "restart", RestartPolicy::kOnFailure,
                     {{"always", RestartPolicy::kAlways},
                      {"on-failure", RestartPolicy::kOnFailure},
                      {"never", RestartPolicy::kNever}});
  g.max_restarts = static_cast<int>(r.integer("max_restarts", 3, 0));
  g.backoff_seconds = r.number("backoff_seconds", 1.0);
  g.scope = choice(r, "scope", g.training ? Scope::kGeneration : Scope::kJob,
                   {{"generation", Scope::kGeneration},
                    {"job", Scope::kJob},
                    {"long-lived", Scope::kLongLived}});
  g.health = parse_health(r);
  g.ready_timeout_seconds = r.number("ready_timeout_seconds", 60);
  g.after = r.strings("after");
  if (const toml::node* env = r.get("env")) {
    if (!env->is_table()) r.fail(*env, "env", "must be a table of strings: { NAME = \"value\" }");
    for (const auto& [key, value] : *env->as_table()) {
      if (!value.is_string()) r.fail(value, "env." + std::string(key.str()), "must be a string");
      g.env[std::string(key.str())] = std::string(value.as_string()->get());
    }
  }
  if (const toml::node* cpus = r.get("cpus")) {
    if (!cpus->is_array()) r.fail(*cpus, "cpus", "must be an array of core numbers");
    for (const toml::node& core : *cpus->as_array()) {
      if (!core.is_integer() || core.as_integer()->get() < 0)
        r.fail(core, "cpus", "must be an array of core numbers (integers from 0)");
      g.cpus.push_back(static_cast<int>(core.as_integer()->get()));
    }
  }
  r.check_unknown(
      "kind, command, procs_per_node, replicas, placement, restart, max_restarts, "
      "backoff_seconds, scope, health, ready_timeout_seconds, after, env and cpus");
  // What only one of the kinds may say.
  if (g.training) {
    if (r.get("placement") != nullptr || r.get("replicas") != nullptr)
      r.fail(node, "placement",
             "the training group runs procs_per_node on every node; "
             "placement and replicas are for services");
    if (g.scope != Scope::kGeneration)
      r.fail(*r.get("scope"), "scope",
             "the training group's "
             "scope is generation");
  } else if (r.get("procs_per_node") != nullptr) {
    r.fail(*r.get("procs_per_node"), "procs_per_node",
           "is for the training group; a service's processes are its replicas");
  }
  return g;
}

// "a -> b -> a", when following `after` from some group returns to it.
std::optional<std::string> find_cycle(const JobSpec& spec) {
  std::map<std::string, int> state;  // 0 unvisited, 1 on the path, 2 done
  std::vector<std::string> path;
  std::optional<std::string> cycle;
  std::function<void(const GroupSpec&)> visit = [&](const GroupSpec& g) {
    if (cycle) return;
    state[g.name] = 1;
    path.push_back(g.name);
    for (const std::string& before : g.after) {
      const int s = state[before];
      if (s == 1) {
        std::string text;
        const auto from = std::find(path.begin(), path.end(), before);
        for (auto it = from; it != path.end(); ++it) text += *it + " -> ";
        cycle = text + before;
        return;
      }
      if (s == 0) visit(*spec.find(before));
      if (cycle) return;
    }
    path.pop_back();
    state[g.name] = 2;
  };
  for (const GroupSpec& g : spec.groups) {
    if (state[g.name] == 0) visit(g);
  }
  return cycle;
}

}  // namespace

const char* to_string(RestartPolicy policy) {
  switch (policy) {
    case RestartPolicy::kAlways:
      return "always";
    case RestartPolicy::kOnFailure:
      return "on-failure";
    case RestartPolicy::kNever:
      return "never";
  }
  return "?";
}

const char* to_string(Scope scope) {
  switch (scope) {
    case Scope::kGeneration:
      return "generation";
    case Scope::kJob:
      return "job";
    case Scope::kLongLived:
      return "long-lived";
  }
  return "?";
}

const GroupSpec& JobSpec::training() const {
  for (const GroupSpec& g : groups) {
    if (g.training) return g;
  }
  throw InvalidArgument(concat(file.string(), ": the job has no training group"));
}

namespace {

// `text` with "{port}" and "{replica}" replaced.
std::string substitute(std::string text, int port, int replica) {
  for (const auto& [from, to] :
       {std::pair<std::string, std::string>{"{port}", std::to_string(port)},
        {"{replica}", std::to_string(replica)}}) {
    for (size_t at = text.find(from); at != std::string::npos;
         at = text.find(from, at + to.size())) {
      text.replace(at, from.size(), to);
    }
  }
  return text;
}

}  // namespace

int GroupSpec::port_of(int replica) const { return health.port > 0 ? health.port + replica : 0; }

std::vector<std::string> GroupSpec::command_of(int replica) const {
  std::vector<std::string> out;
  for (const std::string& arg : command) out.push_back(substitute(arg, port_of(replica), replica));
  return out;
}

std::map<std::string, std::string> GroupSpec::env_of(int replica) const {
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : env) out[key] = substitute(value, port_of(replica), replica);
  return out;
}

int GroupSpec::replica_count(int nodes) const {
  if (training) return procs_per_node * nodes;
  switch (placement.kind) {
    case Placement::Kind::kEveryNode:
      return nodes;
    case Placement::Kind::kNode:
      return 1;
    case Placement::Kind::kSpread:
      return placement.replicas;
  }
  return 1;
}

std::string GroupSpec::registry_name(int replica) const {
  return replica == 0 ? name : concat(name, "@", replica);
}

const GroupSpec* JobSpec::find(const std::string& name) const {
  for (const GroupSpec& g : groups) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

std::vector<std::string> JobSpec::start_order() const {
  std::vector<std::string> order;
  std::set<std::string> placed;
  while (order.size() < groups.size()) {
    const size_t before = order.size();
    for (const GroupSpec& g : groups) {
      if (placed.count(g.name) != 0) continue;
      const bool ready = std::all_of(g.after.begin(), g.after.end(),
                                     [&](const std::string& n) { return placed.count(n) != 0; });
      if (!ready) continue;
      order.push_back(g.name);
      placed.insert(g.name);
      break;  // the earliest in the file first, every time
    }
    LOOM_CHECK(order.size() > before, InvalidArgument, file.string(),
               ": the groups' start order has a cycle");
  }
  return order;
}

std::vector<std::pair<std::string, int>> JobSpec::processes_on(int node) const {
  std::vector<std::pair<std::string, int>> out;
  for (const std::string& name : start_order()) {
    const GroupSpec& g = *find(name);
    if (g.training) {
      for (int local = 0; local < g.procs_per_node; ++local) out.emplace_back(name, local);
      continue;
    }
    switch (g.placement.kind) {
      case Placement::Kind::kEveryNode:
        out.emplace_back(name, node);
        break;
      case Placement::Kind::kNode:
        if (g.placement.node == node) out.emplace_back(name, 0);
        break;
      case Placement::Kind::kSpread:
        for (int replica = node; replica < g.placement.replicas; replica += nodes) {
          out.emplace_back(name, replica);
        }
        break;
    }
  }
  return out;
}

JobSpec parse_job_spec(const std::filesystem::path& file) {
  const toml::table root = internal::read_toml_file(file, "job spec");
  JobSpec spec;
  spec.file = file;
  Reader top(file, root, "");
  if (const toml::node* job = top.get("job")) {
    if (!job->is_table()) top.fail(*job, "job", "must be a table ([job])");
    Reader r(file, *job->as_table(), "job.");
    spec.nodes = static_cast<int>(r.integer("nodes", 1, 1));
    r.check_unknown("nodes");
  }
  const toml::node* groups = top.get("group");
  top.check_unknown("job and group");
  if (groups == nullptr || !groups->is_table() || groups->as_table()->empty()) {
    throw ConfigError(concat(file.string(),
                             ": no process groups; declare the training workers as [group.NAME] "
                             "with kind = \"training\" and a command"));
  }
  for (const auto& [name, node] : *groups->as_table()) {
    spec.groups.push_back(parse_group(file, std::string(name.str()), node));
  }
  std::sort(spec.groups.begin(), spec.groups.end(),
            [](const GroupSpec& a, const GroupSpec& b) { return a.line < b.line; });
  std::vector<std::string> training;
  for (const GroupSpec& g : spec.groups) {
    if (g.training) training.push_back(g.name);
  }
  LOOM_CHECK(
      training.size() == 1, ConfigError, file.string(), ": ", training.size(), " training groups (",
      [&] {
        std::string names;
        for (const auto& n : training) names += (names.empty() ? "" : ", ") + n;
        return names.empty() ? std::string("none") : names;
      }(),
      "); a job has exactly one group with kind = \"training\"");
  for (const GroupSpec& g : spec.groups) {
    const std::string where = concat(file.string(), ":", g.line, ": group.", g.name);
    for (const std::string& before : g.after) {
      LOOM_CHECK(spec.find(before) != nullptr, ConfigError, where, ".after: no group named \"",
                 before, "\" in the job");
      LOOM_CHECK(before != g.name, ConfigError, where, ".after: a group cannot wait for itself");
    }
    if (!g.training && g.placement.kind == Placement::Kind::kNode) {
      LOOM_CHECK(g.placement.node < spec.nodes, ConfigError, where,
                 ".placement: node:", g.placement.node, " cannot be met: the job has ", spec.nodes,
                 " node(s), numbered from 0 (job.nodes)");
    }
  }
  std::map<std::string, std::string> env_names;  // LOOM_SERVICE_<NAME> -> group
  for (const GroupSpec& g : spec.groups) {
    if (g.training) continue;
    const std::string where = concat(file.string(), ":", g.line, ": group.", g.name);
    const std::string var = service_env_name(g.name);
    LOOM_CHECK(var != "LOOM_SERVICE_NAME" && var != "LOOM_SERVICE_REPLICA", ConfigError, where,
               ": the name is taken: a service gets its own name and replica as ", var,
               "; rename the group");
    const auto [other, fresh] = env_names.emplace(var, g.name);
    LOOM_CHECK(fresh, ConfigError, where, ": groups ", other->second, " and ", g.name,
               " would both be found as ", var, "; rename one of them");
    const bool uses_port = [&] {
      bool found = false;
      for (const std::string& arg : g.command) found = found || arg.find("{port}") != arg.npos;
      for (const auto& [key, value] : g.env) found = found || value.find("{port}") != value.npos;
      return found;
    }();
    LOOM_CHECK(!uses_port || g.health.port > 0, ConfigError, where,
               ": {port} needs a health check with a port (health = { tcp = PORT } or { http = "
               "\"/path\", port = PORT }): replica r gets PORT + r");
    const int last = g.port_of(g.replica_count(spec.nodes) - 1);
    LOOM_CHECK(last <= 65535, ConfigError, where, ".health: replica ",
               g.replica_count(spec.nodes) - 1, " would listen on port ", last,
               " (the health check's port + the replica's index), beyond 65535; lower the port");
  }
  for (const GroupSpec& g : spec.groups) {
    const bool waited_for = std::any_of(spec.groups.begin(), spec.groups.end(), [&](const auto& o) {
      return std::find(o.after.begin(), o.after.end(), g.name) != o.after.end();
    });
    LOOM_CHECK(!waited_for || !g.training, ConfigError, file.string(), ":", g.line, ": group.",
               g.name, ": the training group cannot be waited for (services start before it)");
  }
  if (const auto cycle = find_cycle(spec)) {
    throw ConfigError(concat(file.string(), ": the start order has a cycle: ", *cycle,
                             "; remove one of those `after` entries"));
  }
  return spec;
}

std::string describe_plan(const JobSpec& spec) {
  std::ostringstream out;
  const std::vector<std::string> order = spec.start_order();
  out << spec.file.string() << ": " << spec.groups.size() << " group(s) on " << spec.nodes
      << " node(s); start order:";
  for (const std::string& name : order) out << " " << name;
  out << "\n";
  for (const std::string& name : order) {
    const GroupSpec& g = *spec.find(name);
    out << "  " << g.name << (g.training ? " (training)" : "") << ": ";
    for (size_t i = 0; i < g.command.size(); ++i) out << (i ? " " : "") << g.command[i];
    out << "\n    ";
    if (g.training) {
      out << g.procs_per_node << " per node";
    } else if (g.placement.kind == Placement::Kind::kEveryNode) {
      out << "every node";
    } else if (g.placement.kind == Placement::Kind::kNode) {
      out << "node " << g.placement.node;
    } else {
      out << g.placement.replicas << " replica(s) spread";
    }
    out << ", restart " << to_string(g.restart) << " (at most " << g.max_restarts << ", backoff "
        << g.backoff_seconds << " s), scope " << to_string(g.scope) << ", health ";
    // "7000", or "7000-7001" for two replicas (replica r: port + r).
    const int replicas = g.training ? 1 : g.replica_count(spec.nodes);
    const std::string ports =
        replicas > 1 ? concat(g.port_of(0), "-", g.port_of(replicas - 1)) : concat(g.health.port);
    switch (g.health.kind) {
      case Health::Kind::kNone:
        out << "none (ready once started)";
        break;
      case Health::Kind::kTcp:
        out << "tcp port " << ports;
        break;
      case Health::Kind::kHttp:
        out << "http :" << ports << g.health.path;
        break;
      case Health::Kind::kHeartbeat:
        out << "heartbeats through the store";
        break;
    }
    if (!g.after.empty()) {
      out << ", after";
      for (const std::string& a : g.after) out << " " << a;
    }
    out << "\n";
  }
  for (int node = 0; node < spec.nodes; ++node) {
    out << "  node " << node << ":";
    for (const auto& [group, replica] : spec.processes_on(node)) {
      out << " " << group << "/" << replica;
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace loom::control
