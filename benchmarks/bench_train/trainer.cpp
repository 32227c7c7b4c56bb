// bench_train --mode=trainer: train::Trainer's step time beside a hand-written loop over the
// same DataParallel, the plain libtorch loop and PyTorch's Python DDP (main.cpp has the cases).
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "bench_train.h"
#include "comm/group_internal.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/config.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "loom/metrics/trace.h"
#include "loom/parallel/data_parallel.h"
#include "loom/runtime.h"
#include "loom/train/trainer.h"
#include "util/subprocess.h"

namespace bench_train {
namespace {

// A token dataset of random documents, enough for every reader of a run without wrapping.
void write_token_dataset(const Settings& s, const std::filesystem::path& dir) {
  const int64_t rounds = s.warmup + s.steps;
  const int64_t tokens = std::max<int64_t>(1 << 16, 2 * rounds * s.batch * 2 * (s.seq + 1));
  loom::data::TokenDatasetWriter writer(
      dir, {.vocab_size = static_cast<uint64_t>(s.vocab), .description = "bench_train tokens"});
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> token(0, static_cast<uint32_t>(s.vocab - 1));
  std::vector<uint32_t> document(1024);
  for (int64_t written = 0; written < tokens; written += static_cast<int64_t>(document.size())) {
    for (auto& t : document) t = token(rng);
    writer.add_document(document);
  }
  writer.finish();
}

// Rank 0's step times in ms, one per measured round, written by its worker for the parent.
struct TrainerTimes {
  std::vector<double> trainer, hand_dp, hand_plain;
};

// The median over rounds of num[i] / den[i]: a paired figure, steadier than the ratio of
// medians when the load of the machine drifts.
double median_ratio(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> ratios;
  for (size_t i = 0; i < num.size() && i < den.size(); ++i) ratios.push_back(num[i] / den[i]);
  return median(ratios);
}

// Turn-taking with the Python DDP peer (run_trainer_parent starts both at once), so that the two
// alternate round by round and load on the machine falls on both alike: after Loom's round i
// (the Trainer step and the hand loops), Loom's rank 0 writes a byte into the FIFO to_python
// and blocks reading to_loom, into which Python's rank 0 writes after its own round i. Both
// sides block in the kernel while the other runs: a waiting side that polled (200 us sleeps, as
// this did until 2026-12-07) cost the running side's step up to 18%, and Python's polling costs
// more than C++'s. The wait is outside every timed region. When the Python side fails (it
// creates "failed") or takes longer than a deadline, Loom goes on alone and the Python row is
// skipped.
class PythonBaton {
 public:
  explicit PythonBaton(std::string dir) : dir_(std::move(dir)) {}
  ~PythonBaton() {
    if (to_python_ >= 0) ::close(to_python_);
    if (to_loom_ >= 0) ::close(to_loom_);
  }
  PythonBaton(const PythonBaton&) = delete;
  PythonBaton& operator=(const PythonBaton&) = delete;

  // The FIFOs, made by the parent before Python starts.
  static void make_fifos(const std::filesystem::path& dir) {
    for (const char* name : {"to_python", "to_loom"}) {
      LOOM_CHECK(::mkfifo((dir / name).c_str(), 0600) == 0, loom::Error, "bench_train: mkfifo ",
                 (dir / name).string(), ": ", std::strerror(errno));
    }
  }

  // Each rank's batches, in the order its Trainer reads them, for Python to train on the same
  // tokens: rounds x [batch, seq + 1] int64, written before the first round.
  void write_batches(loom::Runtime& rt, const Settings& s,
                     const loom::data::ReaderOptions& reader_options) {
    if (dir_.empty()) return;
    auto reader = rt.open_dataset(s.dataset, reader_options);
    const std::filesystem::path path =
        std::filesystem::path(dir_) / loom::detail::concat("tokens_rank", s.worker_rank, ".bin");
    const std::filesystem::path part = path.string() + ".part";
    {
      std::ofstream out(part, std::ios::binary);
      for (int i = 0; i < s.warmup + s.steps; ++i) {
        const at::Tensor tokens = reader->next()["tokens"].to(torch::kLong).contiguous();
        out.write(static_cast<const char*>(tokens.data_ptr()),
                  static_cast<std::streamsize>(tokens.numel() * sizeof(int64_t)));
      }
      LOOM_CHECK(out.good(), loom::Error, "bench_train: cannot write ", part);
    }
    std::filesystem::rename(part, path);
  }

  // Rank 0: hands a round to Python and blocks until Python has run it.
  void pass() {
    if (dir_.empty() || gone_) return;
    const std::filesystem::path dir(dir_);
    if (to_python_ < 0) {  // O_RDWR: opening a FIFO so never blocks
      to_python_ = ::open((dir / "to_python").c_str(), O_RDWR | O_CLOEXEC);
      to_loom_ = ::open((dir / "to_loom").c_str(), O_RDWR | O_CLOEXEC);
      LOOM_CHECK(to_python_ >= 0 && to_loom_ >= 0, loom::Error, "bench_train: cannot open ",
                 dir.string(), "/to_python or to_loom: ", std::strerror(errno));
    }
    const char token = '1';
    LOOM_CHECK(::write(to_python_, &token, 1) == 1, loom::Error,
               "bench_train: writing to_python: ", std::strerror(errno));
    const auto deadline = Clock::now() + std::chrono::minutes(5);
    for (;;) {
      pollfd fd{to_loom_, POLLIN, 0};
      if (::poll(&fd, 1, 100) == 1) {
        char back = 0;
        LOOM_CHECK(::read(to_loom_, &back, 1) == 1, loom::Error,
                   "bench_train: reading to_loom: ", std::strerror(errno));
        return;
      }
      if (std::filesystem::exists(dir / "failed") || Clock::now() > deadline) {
        gone_ = true;
        return;
      }
    }
  }

 private:
  std::string dir_;
  bool gone_ = false;
  int to_python_ = -1;
  int to_loom_ = -1;
};

loom::Runtime trainer_runtime(const Settings& s) {
  const std::string run_dir = (std::filesystem::path(s.store_dir) / "run").string();
  const std::vector<std::string> args = {"bench_train", "--run.dir=" + run_dir,
                                         "--run.threads=" + std::to_string(s.threads),
                                         "--log.level=warn", "--log.to_file=false"};
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  const loom::Config config =
      loom::Config::from_args(loom::Runtime::schema(), static_cast<int>(argv.size()), argv.data());
  return loom::Runtime::init(config, {.rank = s.worker_rank,
                                      .world_size = s.ranks,
                                      .local_rank = s.worker_rank,
                                      .local_world_size = s.ranks,
                                      .store_dir = std::filesystem::path(s.store_dir) / "store"});
}

std::unique_ptr<loom::parallel::DataParallel> make_data_parallel(std::shared_ptr<Gpt> model,
                                                                 loom::comm::Group& group,
                                                                 const Settings& s) {
  auto dp = std::make_unique<loom::parallel::DataParallel>(
      model, group,
      loom::parallel::DataParallelOptions{.bucket_bytes =
                                              static_cast<size_t>(s.bucket_mib * (1 << 20))});
  dp->set_optimizer(std::make_unique<loom::optim::AdamW>(loom::optim::AdamWOptions{.lr = 1e-4}));
  return dp;
}

// The Trainer's options in both modes: `steps` steps (default: warm-up and measured rounds),
// clipping at 1, a constant rate of 1e-4, nothing resumed.
loom::train::TrainOptions trainer_options(const Settings& s, int64_t steps = -1) {
  loom::train::TrainOptions options;
  options.steps = steps >= 0 ? steps : s.warmup + s.steps;
  options.grad_clip = 1.0;
  options.schedule = loom::train::Schedule::constant(1e-4);
  options.resume = false;
  return options;
}

// The Trainer's loss: the model's next-token loss on the batch's tokens.
loom::train::LossFn gpt_loss(Gpt& model, const Settings& s) {
  return [&model, &s](const loom::data::Batch& batch) {
    const at::Tensor& tokens = batch["tokens"];
    return loom::train::MicroStep{.loss = loss_on(model, s, tokens),
                                  .tokens = tokens.size(0) * s.seq,
                                  .samples = tokens.size(0)};
  };
}

// Trainer steps with one step of each hand-written loop between them (run from the Trainer's
// on_step_end), so that load from other processes falls on all loops alike. Every timed step
// runs from one barrier to the next, so it is the slowest rank's. A Trainer step runs from the
// end of the previous callback to the start of the next one: the whole of fit()'s loop. The
// first `warmup` rounds are not recorded.
TrainerTimes measure_trainer(const Settings& s) {
  loom::Runtime rt = trainer_runtime(s);
  loom::comm::Group& group = rt.world_group();
  const loom::data::ReaderOptions reader_options{.batch_size = s.batch, .seq_len = s.seq};

  auto trainer_model = make_model(s);
  auto trainer_dp = make_data_parallel(trainer_model, group, s);
  auto trainer_reader = rt.open_dataset(s.dataset, reader_options);

  auto dp_model = make_model(s);
  auto hand_dp = make_data_parallel(dp_model, group, s);
  auto dp_reader = rt.open_dataset(s.dataset, reader_options);

  auto plain_model = make_model(s);
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-4));
  auto plain_reader = rt.open_dataset(s.dataset, reader_options);

  PythonBaton python(s.baton);
  python.write_batches(rt, s, reader_options);

  // What people write over DataParallel by hand: the Trainer's work without its bookkeeping.
  auto hand_dp_step = [&] {
    const loom::data::Batch batch = dp_reader->next();
    hand_dp->zero_grad();
    auto loss = loss_on(*dp_model, s, batch["tokens"]);
    loss.backward();
    hand_dp->finish_gradient_sync();
    hand_dp->clip_grad_norm(1.0);
    hand_dp->step();
    (void)loss.item<double>();
  };
  // The plain libtorch loop: gradients all-reduced after backward (sum, then divide).
  auto hand_plain_step = [&] {
    const loom::data::Batch batch = plain_reader->next();
    plain_opt.zero_grad();
    auto loss = loss_on(*plain_model, s, batch["tokens"]);
    loss.backward();
    if (group.size() > 1) {
      for (auto& p : plain_model->parameters()) {
        at::Tensor grad = p.grad();
        group.all_reduce(grad)->wait();
        grad.div_(group.size());
      }
    }
    torch::nn::utils::clip_grad_norm_(plain_model->parameters(), 1.0);
    plain_opt.step();
    (void)loss.item<double>();
  };

  // During Python's turn the ranks sleep for a step; the first step after that runs up to 10%
  // slower (measured: whichever loop came first paid it), so each side's turn starts with an
  // untimed forward and backward of the model its turn then times, without communication:
  // Python's under DDP's no_sync(), the Trainer's under DataParallel's. (Until 2026-12-07 Loom
  // warmed the plain loop's model instead, and the Trainer's step that followed paid for
  // touching another model's memory: 182-195 ms against 154 ms without any warm-up.)
  const at::Tensor warm_tokens = torch::randint(s.vocab, {s.batch, s.seq + 1}, torch::kLong);
  auto warm_up = [&] {
    {
      auto no_sync = trainer_dp->no_sync();
      loss_on(*trainer_model, s, warm_tokens).backward();
    }
    trainer_dp->zero_grad();
    group.barrier()->wait();
  };
  std::vector<double> trainer_ms, hand_dp_ms, hand_plain_ms;
  auto timed = [&](auto&& step, std::vector<double>& out, bool record) {
    group.barrier()->wait();
    const auto start = Clock::now();
    step();
    group.barrier()->wait();
    if (record) out.push_back(ms_since(start));
  };
  auto trainer_start = Clock::now();
  loom::train::Callbacks callbacks;
  callbacks.on_step_end = [&](const loom::train::StepInfo& info) {
    const bool record = info.step >= s.warmup;
    group.barrier()->wait();
    if (record) trainer_ms.push_back(ms_since(trainer_start));
    // The two hand loops swap places every round: a loop that follows the plain libtorch loop
    // pays for it (torch::optim::AdamW's parameter-sized temporaries are returned to the
    // system, and the next loop's first allocations fault their pages in again: 40-50 ms on a
    // 13M-parameter model), so the Trainer and the DataParallel loop each follow it every
    // other round.
    if (info.step % 2 == 0) {
      timed(hand_dp_step, hand_dp_ms, record);
      timed(hand_plain_step, hand_plain_ms, record);
    } else {
      timed(hand_plain_step, hand_plain_ms, record);
      timed(hand_dp_step, hand_dp_ms, record);
    }
    if (group.rank() == 0) python.pass();
    group.barrier()->wait();
    if (!s.baton.empty()) warm_up();
    trainer_start = Clock::now();
  };
  loom::train::Trainer trainer(rt, *trainer_dp, *trainer_reader, trainer_options(s),
                               gpt_loss(*trainer_model, s), callbacks);
  group.barrier()->wait();
  trainer_start = Clock::now();
  trainer.fit();
  return {trainer_ms, hand_dp_ms, hand_plain_ms};
}

void write_line(std::ostream& out, const std::vector<double>& values) {
  for (size_t i = 0; i < values.size(); ++i) out << (i == 0 ? "" : " ") << values[i];
  out << "\n";
}

std::vector<double> read_line(std::istream& in) {
  std::string line;
  std::getline(in, line);
  std::istringstream fields(line);
  std::vector<double> values;
  for (double v; fields >> v;) values.push_back(v);
  return values;
}

}  // namespace

void run_trainer_worker(const Settings& s) {
  const TrainerTimes t = measure_trainer(s);
  if (s.worker_rank != 0) return;
  std::ofstream out(std::filesystem::path(s.store_dir) / "times.txt");
  write_line(out, t.trainer);
  write_line(out, t.hand_dp);
  write_line(out, t.hand_plain);
}

namespace {

// The peer: the same model, batches (the tokens each Loom rank's Trainer reads, from the baton
// directory), optimizer, clipping and thread count in PyTorch's Python DDP (gloo, 2 processes
// by torch.multiprocessing, rendezvous through a file), taking turns with Loom round by round
// (PythonBaton). Every step runs from one barrier to the next, as in measure_trainer; rank 0
// prints the step time of every measured round.
constexpr const char* kPythonDdp = R"PY(
import math, os, select, sys, time

a = dict(arg.split("=", 1) for arg in sys.argv[1:])
baton = a["baton"]


def channel(name):  # a FIFO made by Loom; O_RDWR never blocks on open
    return os.open(os.path.join(baton, name), os.O_RDWR)


def wait_for_turn(fd):  # blocks in the kernel until Loom hands over a round
    if not select.select([fd], [], [], 300)[0]:
        raise TimeoutError("Loom did not hand over a round within 300 s")
    os.read(fd, 1)


try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn as nn
    import torch.nn.functional as F
except BaseException:
    open(os.path.join(baton, "failed"), "w").close()
    raise


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, mask):
        b, t, d = x.shape
        hd = d // self.heads
        parts = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        att = torch.matmul(parts[0], parts[1].transpose(-2, -1)) / math.sqrt(hd)
        att = torch.softmax(att.masked_fill(mask, -1e9), -1)
        y = torch.matmul(att, parts[2]).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok, self.pos = nn.Embedding(a["vocab"], a["dim"]), nn.Embedding(a["seq"], a["dim"])
        self.blocks = nn.ModuleList([Block(a["dim"], a["heads"]) for _ in range(a["layers"])])
        self.lnf = nn.LayerNorm(a["dim"])
        self.head = nn.Linear(a["dim"], a["vocab"], bias=False)

    def forward(self, tokens):
        t = tokens.size(1)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = self.tok(tokens) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.lnf(x))


def worker(rank, a):
    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo", init_method="file://" + a["init"], rank=rank, world_size=a["ranks"])
    torch.manual_seed(7)
    model = nn.parallel.DistributedDataParallel(Gpt(a), bucket_cap_mb=a["bucket_mib"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rounds = a["warmup"] + a["steps"]
    batches, times = None, []
    if rank == 0:
        turn, done = channel("to_python"), channel("to_loom")
    for i in range(rounds):
        if rank == 0:
            wait_for_turn(turn)
        dist.barrier()
        if batches is None:  # written by Loom's rank before its first round
            with open(os.path.join(baton, "tokens_rank%d.bin" % rank), "rb") as f:
                data = bytearray(f.read())
            batches = torch.frombuffer(data, dtype=torch.int64).view(rounds, a["batch"], a["seq"] + 1)
            dist.barrier()
        tokens = batches[i]
        with model.no_sync():  # untimed, as Loom's turn starts (see measure_trainer)
            F.cross_entropy(model(tokens[:, :-1]).reshape(-1, a["vocab"]), tokens[:, 1:].reshape(-1)).backward()
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a["vocab"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        dist.barrier()
        if i >= a["warmup"]:
            times.append((time.perf_counter() - start) * 1e3)
        if rank == 0:
            os.write(done, b"1")
    if rank == 0:
        print("step_ms", " ".join("%.6g" % t for t in times), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        for key in a:
            if key not in ("init", "bucket_mib", "baton"):
                a[key] = int(a[key])
        a["bucket_mib"] = float(a["bucket_mib"])
        mp.spawn(worker, args=(a,), nprocs=a["ranks"])
    except BaseException:
        open(os.path.join(baton, "failed"), "w").close()
        raise
)PY";

// Starts the Python DDP peer taking turns through `baton`; nothing (with a note on stderr)
// when it cannot start.
std::optional<loom::util::Subprocess> start_python_ddp(const Settings& s,
                                                       const std::filesystem::path& dir,
                                                       const std::filesystem::path& baton) {
  const std::filesystem::path script = dir / "python_ddp.py";
  std::ofstream(script) << kPythonDdp;
  std::vector<std::string> argv = {s.python, script.string()};
  const std::pair<const char*, std::string> args[] = {{"ranks", "2"},
                                                      {"vocab", std::to_string(s.vocab)},
                                                      {"dim", std::to_string(s.dim)},
                                                      {"layers", std::to_string(s.layers)},
                                                      {"heads", std::to_string(s.heads)},
                                                      {"seq", std::to_string(s.seq)},
                                                      {"batch", std::to_string(s.batch)},
                                                      {"steps", std::to_string(s.steps)},
                                                      {"warmup", std::to_string(s.warmup)},
                                                      {"threads", std::to_string(s.threads)},
                                                      {"bucket_mib", std::to_string(s.bucket_mib)},
                                                      {"init", (dir / "python_ddp.init").string()},
                                                      {"baton", baton.string()}};
  for (const auto& [key, value] : args) argv.push_back(std::string(key) + "=" + value);
  try {
    return loom::util::Subprocess::spawn({.argv = argv, .output = dir / "python_ddp.out"});
  } catch (const std::exception& e) {
    std::cerr << "bench_train: note: Python DDP rows skipped: " << e.what() << "\n";
    return std::nullopt;
  }
}

// The Python DDP step of every measured round in ms, or nothing (with a note on stderr) when
// it did not run to the end.
std::vector<double> finish_python_ddp(const Settings& s, const std::filesystem::path& dir,
                                      loom::util::Subprocess& python) {
  const loom::util::ExitStatus status = python.wait();
  std::ifstream in(dir / "python_ddp.out");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  const size_t at = text.rfind("step_ms ");
  if (!status.ok() || at == std::string::npos) {
    std::cerr << "bench_train: note: Python DDP rows skipped: " << s.python << " "
              << status.describe() << " (python3 with torch needed; --python to choose):\n"
              << text.substr(text.size() > 2000 ? text.size() - 2000 : 0) << "\n";
    return {};
  }
  std::istringstream line(text.substr(at + 8));
  return read_line(line);
}

}  // namespace

int run_trainer_parent(Settings s, const std::string& self) {
  const std::filesystem::path dir = scratch_dir();
  s.dataset = (dir / "tokens").string();
  write_token_dataset(s, s.dataset);
  const double params_m = parameter_count(*make_model(s)) / 1e6;
  if (!s.json) {
    std::printf(
        "bench_train --mode=trainer: %.2fM-parameter transformer (%lld layers, dim %lld, "
        "vocab %lld), %lld x %lld tokens per rank, %d thread(s) per rank, AdamW, clip 1.0, "
        "median of %d rounds after %d warmup; every round runs one step of each loop, and at 2 "
        "ranks one of Python DDP, in turn, on the same batches\n",
        params_m, (long long)s.layers, (long long)s.dim, (long long)s.vocab, (long long)s.batch,
        (long long)s.seq, s.threads, s.steps, s.warmup);
    emit_columns();
  }
  // ratio: the baseline's median step / the Trainer's; median_round_ratio: the median of the
  // same ratio taken round by round; spread: (max - min) / median over the rounds.
  auto emit_row = [&](const std::string& name, const std::vector<double>& loom_ms,
                      const std::vector<double>& base_ms, const std::string& base_name) {
    auto spread_pct = [](const std::vector<double>& v) {
      return (*std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end())) /
             median(v) * 100;
    };
    emit(s, {"train",
             name,
             median(loom_ms),
             median(base_ms),
             base_name,
             "ms",
             median(base_ms) / median(loom_ms),
             {{"params_m", params_m},
              {"rounds", static_cast<double>(loom_ms.size())},
              {"median_round_ratio", median_ratio(base_ms, loom_ms)},
              {"loom_spread_pct", spread_pct(loom_ms)},
              {"baseline_spread_pct", spread_pct(base_ms)}}});
  };
  for (int ranks : {1, 2}) {
    s.ranks = ranks;
    const std::filesystem::path run = dir / loom::detail::concat("w", ranks);
    // At 2 ranks Python DDP runs at the same time, taking turns with Loom round by round.
    std::optional<loom::util::Subprocess> python;
    s.baton.clear();
    if (ranks == 2) {
      const std::filesystem::path baton = dir / "baton";
      std::filesystem::create_directories(baton);
      PythonBaton::make_fifos(baton);
      python = start_python_ddp(s, dir, baton);
      if (python) s.baton = baton.string();
    }
    if (!run_ranks(s, self, run)) {
      std::cerr << "bench_train: rank logs kept in " << dir << std::endl;
      return 1;
    }
    std::ifstream in(run / "times.txt");
    TrainerTimes t{read_line(in), read_line(in), read_line(in)};
    LOOM_CHECK(!t.trainer.empty() && t.trainer.size() == t.hand_dp.size() &&
                   t.trainer.size() == t.hand_plain.size(),
               loom::Error, "no times from the ", ranks, "-rank run");
    const std::string suffix = ranks == 1 ? "/1rank" : "/2ranks";
    emit_row("trainer_overhead" + suffix, t.trainer, t.hand_dp, "hand_loop_dataparallel");
    emit_row("trainer_vs_plain" + suffix, t.trainer, t.hand_plain,
             ranks == 1 ? "hand_loop_libtorch" : "hand_loop_allreduce_after_backward");
    if (python) {
      const std::vector<double> python_ms = finish_python_ddp(s, dir, *python);
      if (python_ms.size() == t.trainer.size()) {
        emit_row("trainer_vs_python_ddp/2ranks", t.trainer, python_ms, "pytorch_python_ddp_gloo");
      } else if (!python_ms.empty()) {
        std::cerr << "bench_train: note: Python DDP rows skipped: " << python_ms.size()
                  << " rounds from Python, " << t.trainer.size() << " from Loom\n";
      }
    }
  }
  std::filesystem::remove_all(dir);
  return 0;
}

// --- --mode=trace ----------------------------------------------------------------------------

namespace {

// A cycle of kCycle Trainer steps: the first kTraced traced (metrics.trace_steps), then the
// step that flushes the trace file as it begins, then untraced steps. All in one Trainer, so
// that traced and untraced steps share the model, data, threads and machine load.
constexpr int kCycle = 8;
constexpr int kTraced = 4;

enum class StepKind { kWarmup, kTraced, kFlush, kOff };

StepKind kind_of(const Settings& s, int64_t step) {
  if (step < s.warmup) return StepKind::kWarmup;
  const int64_t at = (step - s.warmup) % kCycle;
  return at < kTraced ? StepKind::kTraced : at == kTraced ? StepKind::kFlush : StepKind::kOff;
}

// The cost of one metrics::tracing() check while off, in ns: the median of 9 timings of
// 10 million checks.
double tracing_check_ns() {
  std::vector<double> ns;
  for (int round = 0; round < 9; ++round) {
    const auto start = Clock::now();
    int on = 0;
    for (int i = 0; i < 10'000'000; ++i) on += loom::metrics::tracing() ? 1 : 0;
    ns.push_back(ms_since(start) * 1e6 / 1e7 + (on > 0 ? 1e9 : 0));
  }
  return median(ns);
}

// The cost of recording one span while tracing, in ns, as a collective's is recorded (the
// dearest kind: its arguments are built as JSON): the mean over 20000 spans, the median of 5
// such rounds. Needs a recording StepTracer.
double span_record_ns() {
  loom::comm::internal::GroupState group(0, 2, "world", {}, 16);
  std::vector<double> ns;
  for (int round = 0; round < 5; ++round) {
    const auto start = Clock::now();
    for (int i = 0; i < 20'000; ++i) {
      const int64_t begin = loom::metrics::trace_now_us();
      std::string args = loom::comm::internal::collective_trace_args(
          group, static_cast<uint64_t>(i), "float32", 1 << 20, {});
      loom::comm::internal::trace_collective("all_reduce", begin, std::move(args), false);
    }
    ns.push_back(ms_since(start) * 1e6 / 20'000);
  }
  return median(ns);
}

}  // namespace

void run_trace_worker(const Settings& s) {
  loom::Runtime rt = trainer_runtime(s);
  loom::comm::Group& group = rt.world_group();
  auto model = make_model(s);
  auto dp = make_data_parallel(model, group, s);
  auto reader = rt.open_dataset(s.dataset, {.batch_size = s.batch, .seq_len = s.seq});
  std::vector<double> traced_ms, flush_ms, off_ms;
  auto start = Clock::now();
  loom::train::Callbacks callbacks;
  // Every step runs from one barrier to the next (the slowest rank's), as in measure_trainer.
  callbacks.on_step_end = [&](const loom::train::StepInfo& info) {
    group.barrier()->wait();
    const double ms = ms_since(start);
    switch (kind_of(s, info.step)) {
      case StepKind::kTraced:
        traced_ms.push_back(ms);
        break;
      case StepKind::kFlush:
        flush_ms.push_back(ms);
        break;
      case StepKind::kOff:
        off_ms.push_back(ms);
        break;
      case StepKind::kWarmup:
        break;
    }
    start = Clock::now();
  };
  loom::train::TrainOptions options = trainer_options(s, s.warmup + s.steps * kCycle);
  for (int64_t step = 0; step < options.steps; ++step) {
    if (kind_of(s, step) == StepKind::kTraced) options.trace_steps.push_back(step);
  }
  loom::train::Trainer trainer(rt, *dp, *reader, options, gpt_loss(*model, s), callbacks);
  group.barrier()->wait();
  start = Clock::now();
  trainer.fit();
  // Rank 0's trace file is complete now; the cost of one span is measured into another run
  // directory's, as a process that records nothing else.
  if (s.worker_rank != 0) return;
  double record_ns = 0;
  {
    loom::Runtime solo = loom::Runtime::init(
        loom::Config::load(
            loom::Runtime::schema(),
            {.read_env = false,
             .overrides = {"run.dir=" + (std::filesystem::path(s.store_dir) / "span_cost").string(),
                           "log.level=warn", "log.to_file=false"}}),
        loom::Topology{.rank = 0, .world_size = 1}, /*configure_process=*/false);
    loom::metrics::StepTracer tracer(solo, {0});
    tracer.begin_step(0);
    record_ns = span_record_ns();
  }
  std::ofstream out(std::filesystem::path(s.store_dir) / "times.txt");
  write_line(out, traced_ms);
  write_line(out, flush_ms);
  write_line(out, off_ms);
  write_line(out, {tracing_check_ns(), record_ns});
}

int run_trace_parent(Settings s, const std::string& self) {
  const std::filesystem::path dir = scratch_dir();
  s.dataset = (dir / "tokens").string();
  write_token_dataset(s, s.dataset);
  const double params_m = parameter_count(*make_model(s)) / 1e6;
  if (!s.json) {
    std::printf(
        "bench_train --mode=trace: the Trainer on a %.2fM-parameter transformer, %d ranks, %d "
        "thread(s) per rank; %d cycles of %d steps after %d warmup: %d traced "
        "(metrics.trace_steps), 1 that writes the trace file as it begins, %d untraced; "
        "medians per kind of step\n",
        params_m, s.ranks, s.threads, s.steps, kCycle, s.warmup, kTraced, kCycle - kTraced - 1);
    emit_columns();
  }
  const std::filesystem::path run = dir / "run";
  if (!run_ranks(s, self, run)) {
    std::cerr << "bench_train: rank logs kept in " << dir << std::endl;
    return 1;
  }
  std::ifstream in(run / "times.txt");
  const std::vector<double> traced = read_line(in), flush = read_line(in), off = read_line(in),
                            check = read_line(in);
  LOOM_CHECK(!traced.empty() && !flush.empty() && !off.empty() && check.size() == 2, loom::Error,
             "no times from the run");
  // The spans one traced step records (rank 0's file): each passed one tracing() check, as the
  // same sites do in an untraced step.
  const std::filesystem::path file = run / "run" / "traces" / "rank_0.json";
  std::ifstream trace_in(file);
  const std::string trace_text((std::istreambuf_iterator<char>(trace_in)), {});
  size_t spans = 0;
  for (size_t at = trace_text.find("\"ph\":\"X\""); at != std::string::npos;
       at = trace_text.find("\"ph\":\"X\"", at + 1)) {
    ++spans;
  }
  const double spans_per_step =
      static_cast<double>(spans) / (static_cast<double>(s.steps) * kTraced);
  auto spread_pct = [](const std::vector<double>& v) {
    return (*std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end())) /
           median(v) * 100;
  };
  // Paired by cycle (steps seconds apart, so drift in the machine's load cancels): the median
  // over cycles of (the cycle's untraced median / its `per_cycle` steps' median).
  auto cycle_ratio = [&](const std::vector<double>& steps, size_t per_cycle) {
    std::vector<double> ratios;
    const size_t off_per_cycle = static_cast<size_t>(kCycle - kTraced - 1);
    for (size_t c = 0; (c + 1) * per_cycle <= steps.size() && (c + 1) * off_per_cycle <= off.size();
         ++c) {
      const std::vector<double> mine(steps.begin() + c * per_cycle,
                                     steps.begin() + (c + 1) * per_cycle);
      const std::vector<double> base(off.begin() + c * off_per_cycle,
                                     off.begin() + (c + 1) * off_per_cycle);
      ratios.push_back(median(base) / median(mine));
    }
    return median(ratios);
  };
  auto row = [&](const std::string& name, double loom_ms, const std::vector<double>& loom_all,
                 const std::string& base_name, std::map<std::string, double> extra) {
    extra["params_m"] = params_m;
    extra["rounds"] = static_cast<double>(loom_all.size());
    extra["loom_spread_pct"] = spread_pct(loom_all);
    extra["baseline_rounds"] = static_cast<double>(off.size());
    extra["baseline_spread_pct"] = spread_pct(off);
    extra["spans_per_traced_step"] = spans_per_step;
    emit(s, {"train", name, loom_ms, median(off), base_name, "ms", median(off) / loom_ms, extra});
  };
  const std::string suffix = loom::detail::concat("/", s.ranks, s.ranks == 1 ? "rank" : "ranks");
  row("tracing_on" + suffix, median(traced), traced, "untraced_steps_same_run",
      {{"median_cycle_ratio", cycle_ratio(traced, kTraced)}});
  row("trace_flush_step" + suffix, median(flush), flush, "untraced_steps_same_run",
      {{"median_cycle_ratio", cycle_ratio(flush, 1)}});
  // On, each span's recording (measured apart, as a collective's) times the spans of a step.
  const double on_cost_ms = check[1] * spans_per_step / 1e6;
  row("tracing_on_estimate" + suffix, median(off) + on_cost_ms, off, "untraced_step_without_spans",
      {{"span_ns", check[1]}});
  // Off, every recording site is one relaxed atomic load: its measured cost times the sites a
  // step passes (one per span a traced step records), added to the untraced step.
  const double off_cost_ms = check[0] * spans_per_step / 1e6;
  row("tracing_off_estimate" + suffix, median(off) + off_cost_ms, off,
      "untraced_step_without_checks", {{"check_ns", check[0]}});
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace bench_train
