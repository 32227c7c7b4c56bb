// `loom run`: the launcher. One agent per node; node 0 hosts the coordinator. Restarts the
// workers on failure, continues at a smaller world size when a node is lost (elastic), and
// reads its layout from Slurm's environment when there. docs/launcher.md.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/control/agent.h"
#include "loom/control/coordinator.h"
#include "loom/control/job_spec.h"
#include "loom/error.h"

namespace loom::cli {
namespace {

double seconds_of(std::chrono::milliseconds d) { return static_cast<double>(d.count()) / 1000; }

// `loom run`'s defaults are the agent's (loom/control/agent.h), stated there once.
const control::AgentOptions kAgentDefaults;

struct RunArgs {
  std::string nnodes = "1";
  int nproc_per_node = -1;  // not given: $SLURM_NTASKS_PER_NODE or 1
  int node_rank = -1;
  std::string coordinator;
  bool coordinator_public = false;
  int max_restarts = 0;
  bool standalone = false;
  std::string run_id = kAgentDefaults.run_id;
  std::string run_dir = kAgentDefaults.run_dir.string();
  std::string snapshot_root = kAgentDefaults.snapshot_root.string();
  bool no_snapshots = false;
  double grace_s = seconds_of(kAgentDefaults.grace);
  double rendezvous_timeout_s = seconds_of(kAgentDefaults.rendezvous_timeout);
  double node_timeout_s = seconds_of(kAgentDefaults.node_timeout);
  double worker_timeout_s = seconds_of(kAgentDefaults.worker_timeout);
  double last_call_s = seconds_of(kAgentDefaults.last_call);
  std::string tls_cert, tls_key, tls_ca;
  std::string metrics_address;
  double straggler_threshold = kAgentDefaults.straggler_threshold;
  size_t straggler_window = kAgentDefaults.straggler_window;
  double hang_factor = kAgentDefaults.hang_factor;
  double hang_min_seconds = kAgentDefaults.hang_min_seconds;
  std::vector<std::string> program;
  std::string job;     // --job FILE: a job spec (loom/control/job_spec.h)
  bool check = false;  // --check: validate the job spec and print its plan
};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// A count from Slurm's environment ("4", or "4(x2)" for SLURM_NTASKS_PER_NODE): an integer in
// [min, 4096] or InvalidArgument naming the variable.
int slurm_count(const char* name, int min) {
  const std::string text = env(name);
  const std::string number = text.substr(0, text.find('('));
  size_t used = 0;
  int value = -1;
  try {
    value = std::stoi(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used == number.size() && !number.empty() && value >= min && value <= 4096,
             InvalidArgument, "$", name, " is '", text, "'; expected an integer in [", min,
             ", 4096]");
  return value;
}

// The first host of a Slurm node list: "gpu[01-04,07]" -> "gpu01", "a,b" -> "a".
std::string first_slurm_host(const std::string& list) {
  const auto bracket = list.find('[');
  const auto comma = list.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return list.substr(0, comma);
  }
  const std::string prefix = list.substr(0, bracket);
  const std::string range = list.substr(bracket + 1);
  return prefix + range.substr(0, range.find_first_of("-,]"));
}

// A number above `min` (or equal, with `or_equal`); otherwise CLI11 prints
// "--flag: must be <what>, got <value>".
CLI::Validator number_above(double min, const std::string& what, bool or_equal = false) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        size_t used = 0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        const bool ok = used == text.size() && std::isfinite(v) && (or_equal ? v >= min : v > min);
        return ok ? "" : "must be " + what + ", got '" + text + "'";
      },
      what);
}

// --job: the spec's training group becomes the program; its services go to the agent.
void apply_job_spec(RunArgs& args, const control::JobSpec& spec) {
  LOOM_CHECK(args.program.empty(), InvalidArgument,
             "--job gives the program (its training group's command); drop the program after --");
  const control::GroupSpec& training = spec.training();
  args.program = training.command;
  if (args.nproc_per_node < 0) args.nproc_per_node = training.procs_per_node;
  if (args.nnodes == "1") args.nnodes = std::to_string(spec.nodes);
  if (args.max_restarts == 0) args.max_restarts = training.max_restarts;
}

int run(RunArgs args) {
  std::optional<control::JobSpec> job;
  if (!args.job.empty()) {
    const control::JobSpec spec = control::parse_job_spec(args.job);
    if (args.check) {
      std::cout << control::describe_plan(spec);
      return 0;
    }
    apply_job_spec(args, spec);
    job = spec;
  }
  LOOM_CHECK(!args.program.empty(), InvalidArgument,
             "give the program and its arguments after --, or a job spec with --job FILE");
  if (args.standalone) {
    LOOM_CHECK(args.coordinator.empty() && (args.nnodes == "1"), InvalidArgument,
               "--standalone is one node with a coordinator on a free loopback port: drop "
               "--nnodes and --coordinator/--rdzv-endpoint");
  }
  control::AgentOptions o;
  o.program = args.program;
  const auto colon = args.nnodes.find(':');
  try {
    o.min_nodes = std::stoi(args.nnodes.substr(0, colon));
    o.max_nodes =
        colon == std::string::npos ? o.min_nodes : std::stoi(args.nnodes.substr(colon + 1));
  } catch (const std::exception&) {
    throw InvalidArgument("--nnodes must be N or MIN:MAX, got '" + args.nnodes + "'");
  }
  LOOM_CHECK(o.min_nodes >= 1 && o.min_nodes <= o.max_nodes, InvalidArgument,
             "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '", args.nnodes, "'");
  // Slurm: one `loom run` per node (srun --ntasks-per-node=1 loom run ...).
  if (!env("SLURM_JOB_ID").empty() && !env("SLURM_NODEID").empty()) {
    if (args.nnodes == "1" && !env("SLURM_NNODES").empty())
      o.min_nodes = o.max_nodes = slurm_count("SLURM_NNODES", 1);
    if (args.node_rank < 0) args.node_rank = slurm_count("SLURM_NODEID", 0);
    if (args.coordinator.empty() && !env("SLURM_JOB_NODELIST").empty()) {
      args.coordinator = first_slurm_host(env("SLURM_JOB_NODELIST")) + ":29400";
    }
    if (args.nproc_per_node < 0 && !env("SLURM_NTASKS_PER_NODE").empty()) {
      args.nproc_per_node = slurm_count("SLURM_NTASKS_PER_NODE", 1);
    }
  }
  o.nproc_per_node = args.nproc_per_node < 0 ? 1 : args.nproc_per_node;
  o.node_rank = args.node_rank;
  o.coordinator = args.coordinator;
  o.host_coordinator = !args.coordinator.empty() && args.node_rank == 0;
  LOOM_CHECK(
      !args.coordinator.empty() || o.max_nodes == 1, InvalidArgument,
      "more than one node needs --coordinator host:port (node 0 hosts it, the others join it)");
  o.coordinator_public = args.coordinator_public;
  o.token = env("LOOM_JOB_TOKEN");
  const bool hosts = o.host_coordinator || o.coordinator.empty();
  if (o.token.empty() && hosts && (o.max_nodes == 1 || o.coordinator_public)) {
    o.token = control::generate_token();
    if (o.max_nodes > 1) {
      std::cerr << "[loom run] job token generated; start the other nodes with LOOM_JOB_TOKEN="
                << o.token << "\n";
    }
  }
  LOOM_CHECK(!o.token.empty() || !o.coordinator_public, InvalidArgument,
             "a public coordinator needs the job token: set LOOM_JOB_TOKEN on every node");
  // TLS is mutual under `loom run`: every node has a certificate signed by the job's CA.
  const int tls_given = !args.tls_cert.empty() + !args.tls_key.empty() + !args.tls_ca.empty();
  LOOM_CHECK(tls_given == 0 || tls_given == 3, InvalidArgument,
             "TLS needs all of --tls-cert, --tls-key and --tls-ca on every node; missing:",
             args.tls_cert.empty() ? " --tls-cert" : "", args.tls_key.empty() ? " --tls-key" : "",
             args.tls_ca.empty() ? " --tls-ca" : "");
  if (tls_given == 3) {
    // Absolute, since the workers get them too (LOOM_TLS_*) and may change directory.
    o.tls = {std::filesystem::absolute(args.tls_cert), std::filesystem::absolute(args.tls_key),
             std::filesystem::absolute(args.tls_ca)};
  }
  o.max_restarts = args.max_restarts;
  o.run_id = args.run_id;
  o.run_dir = args.run_dir;
  o.snapshot_root = args.no_snapshots ? "" : args.snapshot_root;
  const auto ms = [](double s) {
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  };
  o.grace = ms(args.grace_s);
  o.rendezvous_timeout = ms(args.rendezvous_timeout_s);
  o.node_timeout = ms(args.node_timeout_s);
  o.worker_timeout = ms(args.worker_timeout_s);
  o.last_call = ms(args.last_call_s);
  o.metrics_address = args.metrics_address;
  o.straggler_threshold = args.straggler_threshold;
  o.straggler_window = args.straggler_window;
  o.hang_factor = args.hang_factor;
  o.hang_min_seconds = args.hang_min_seconds;
  o.job = std::move(job);
  return control::run_agent(o);
}

}  // namespace

void register_run(CLI::App& app, Action& action) {
  auto args = std::make_shared<RunArgs>();
  CLI::App* run_cmd = app.add_subcommand(
      "run", "Launch a training program on this node's workers (torchrun-like).");
  // torchrun's spellings (dashes and underscores) are accepted, so that `torchrun` can be
  // replaced by `loom run` in a command line.
  run_cmd->add_option("--nnodes", args->nnodes, "nodes: N, or MIN:MAX for an elastic job")
      ->capture_default_str();
  run_cmd
      ->add_option("--nproc-per-node,--nproc_per_node", args->nproc_per_node,
                   "workers on this node, 1 to 4096 (default 1, or Slurm's)")
      ->check(CLI::Range(1, 4096));
  run_cmd->add_option("--node-rank,--node_rank", args->node_rank,
                      "this node's rank; node 0 hosts the coordinator");
  run_cmd->add_option(
      "--coordinator,--rdzv-endpoint,--rdzv_endpoint", args->coordinator,
      "host:port of the coordinator (node 0 listens there); single node: any free port");
  run_cmd->add_flag("--standalone", args->standalone,
                    "one node, the coordinator on a free loopback port (the default for one node)");
  run_cmd
      ->add_option("--rdzv-id,--rdzv_id", args->run_id,
                   "the job's id, given to the workers as TORCHELASTIC_RUN_ID")
      ->capture_default_str();
  run_cmd->add_flag(
      "--coordinator-public", args->coordinator_public,
      "allow the coordinator to listen beyond loopback (every RPC then needs LOOM_JOB_TOKEN)");
  run_cmd
      ->add_option("--max-restarts,--max_restarts", args->max_restarts,
                   "worker failures tolerated (each restarts all workers)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  run_cmd
      ->add_option("--run-dir", args->run_dir,
                   "logs/worker_<rank>.out go here; workers get LOOM_RUN_DIR")
      ->capture_default_str();
  run_cmd
      ->add_option("--snapshot-root", args->snapshot_root,
                   "in-memory snapshots: this node's agent holds a directory under it (tmpfs) "
                   "for the job, given to the workers as LOOM_SNAPSHOT_DIR")
      ->capture_default_str();
  run_cmd->add_flag("--no-snapshots", args->no_snapshots,
                    "no in-memory snapshots: restarts resume from disk checkpoints only");
  run_cmd
      ->add_option("--grace-period", args->grace_s,
                   "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  run_cmd
      ->add_option("--rendezvous-timeout", args->rendezvous_timeout_s,
                   "seconds to wait for the nodes to join")
      ->capture_default_str();
  run_cmd
      ->add_option("--node-timeout", args->node_timeout_s,
                   "seconds of agent silence before its node is lost")
      ->capture_default_str();
  run_cmd
      ->add_option("--worker-timeout", args->worker_timeout_s,
                   "seconds of silence from a worker that heartbeats before it counts as hung")
      ->capture_default_str();
  run_cmd
      ->add_option("--last-call", args->last_call_s,
                   "elastic: seconds to wait for more nodes once MIN have joined")
      ->capture_default_str();
  run_cmd->add_option("--tls-cert", args->tls_cert,
                      "TLS: this node's PEM certificate (the coordinator's on the node hosting "
                      "it, the client's on every node); with --tls-key and --tls-ca");
  run_cmd->add_option("--tls-key", args->tls_key, "TLS: the PEM private key of --tls-cert");
  run_cmd->add_option("--tls-ca", args->tls_ca,
                      "TLS: the PEM certificate of the CA that signed every node's certificate; "
                      "the coordinator and its clients verify each other against it");
  run_cmd->add_option("--metrics-address", args->metrics_address,
                      "node 0: serve the job's metrics over HTTP at host:port: /metrics for "
                      "Prometheus, /api/metrics for `loom top` (port 0: any; see the log)");
  run_cmd
      ->add_option("--straggler-threshold", args->straggler_threshold,
                   "flag a rank whose step time outside collective waits exceeds this many "
                   "times the other ranks' median (above 1)")
      ->capture_default_str()
      ->check(number_above(1, "a ratio above 1 (1.3: 30% more than the others)"));
  run_cmd
      ->add_option("--straggler-window", args->straggler_window,
                   "heartbeats (about one a second) each rank's median is taken over, 1 to 3600")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  run_cmd
      ->add_option("--hang-factor", args->hang_factor,
                   "the job is hung when no rank finishes a step for this many median step "
                   "times (and --hang-min-seconds): each rank's phase and collective are logged "
                   "and flight recorders dumped; 0: off")
      ->capture_default_str()
      ->check(number_above(0, "a number >= 0 (0: off)", true));
  run_cmd
      ->add_option("--hang-min-seconds", args->hang_min_seconds,
                   "the hang watchdog waits at least this long without a finished step")
      ->capture_default_str()
      ->check(number_above(0, "seconds >= 0", true));
  run_cmd->add_option("program", args->program, "the program and its arguments (after --)");
  run_cmd->add_option("--job", args->job,
                      "a job spec (TOML): the training group's command, procs_per_node, nodes "
                      "and max_restarts instead of the program and flags (docs/launcher.md)");
  run_cmd->add_flag("--check", args->check,
                    "with --job: check the spec and print its plan (groups, start order, each "
                    "node's processes), then exit");
  run_cmd->footer(
      "Examples:\n"
      "  loom run --nproc-per-node 2 -- build/examples/fashion_mnist "
      "--config=examples/fashion_mnist/config.toml\n"
      "  node 0: loom run --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29400 "
      "--coordinator-public -- prog\n"
      "  node 1: LOOM_JOB_TOKEN=<printed by node 0> loom run --nnodes 2 --node-rank 1 "
      "--coordinator 10.0.0.1:29400 -- prog\n"
      "  torchrun's programs: loom run --nproc_per_node 2 -- python3 train.py\n"
      "  Prometheus and `loom top`: loom run --metrics-address 127.0.0.1:9400 ... ; "
      "loom top 127.0.0.1:9400\n"
      "  TLS (mutual): add --tls-cert node.pem --tls-key node.key --tls-ca ca.pem on every "
      "node\n"
      "Each worker gets LOOM_RANK, LOOM_WORLD_SIZE, LOOM_LOCAL_RANK, LOOM_COORDINATOR, "
      "LOOM_GENERATION,\n"
      "LOOM_JOB_TOKEN and torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
      "MASTER_PORT, ...:\n"
      "rank 0 hosts a c10d TCPStore there, as init_process_group does); its output is prefixed "
      "[rank r] and\n"
      "kept in <run-dir>/logs. A failed worker restarts all workers (up to --max-restarts); the "
      "exit\n"
      "code is the first failure's. SIGINT/SIGTERM stop the workers gracefully. docs/launcher.md.");
  run_cmd->callback([args, &action] { action = [args] { return run(*args); }; });
}

}  // namespace loom::cli
