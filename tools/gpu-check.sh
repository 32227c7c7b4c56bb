#!/usr/bin/env bash
# On a one-GPU machine with PyTorch and no network (this workplace's H200 image, see
# docs/testing.md): builds Loom with CUDA against that PyTorch's libtorch
# (torch.utils.cmake_prefix_path) and its NCCL, runs every GPU-labelled test (each kernel
# against its CPU reference, NCCL at world size 1, CUDA AdamW against the CPU step, the measured
# bf16 matmul peak), then trains GPT-2 124M (examples/gpt/configs/gpt2-124m.toml, bf16) for 60 s
# and prints tokens/s and MFU, and one summary table at the end. Budget: under 8 minutes.
# Needs the Debian -dev packages of tools/install-deps.sh other than libtorch (it says which are
# missing) and, for the GPT run, data/kjv-train-bpe and data/kjv-val-bpe (built on any machine by
# tools/run-gpt.sh; carry data/ over).
#   tools/gpu-check.sh [build-dir]      (default build-gpu)
#   LOOM_GPU_CHECK_SECONDS=60           length of the GPT-2 run
#   LOOM_GPU_CHECK_DRY_RUN=1            print the commands instead of running them (any machine)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${1:-build-gpu}
seconds=${LOOM_GPU_CHECK_SECONDS:-60}
dry_run=${LOOM_GPU_CHECK_DRY_RUN:-0}
log_dir=$build_dir/gpu-check
python=${LOOM_PYTHON:-python3}

declare -a rows=()
failed=0
# row STAGE RESULT DETAIL: one line of the summary table.
row() { rows+=("$(printf '| %-22s | %-6s | %s |' "$1" "$2" "$3")"); }
# run LOG COMMAND...: runs it (or prints it in a dry run), its output in LOG and on the terminal.
run() {
  local log=$1
  shift
  if [ "$dry_run" = 1 ]; then
    echo "+ $*"
    return 0
  fi
  "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
summary() {
  echo
  echo "gpu-check summary ($(( $(date +%s) - start )) s in all)"
  echo "| stage                  | result | detail |"
  echo "| ---------------------- | ------ | ------ |"
  printf '%s\n' "${rows[@]}"
  exit "$failed"
}

start=$(date +%s)
mkdir -p "$log_dir"

# --- the machine ---------------------------------------------------------------------------
if [ "$dry_run" = 1 ]; then
  gpu="(dry run)"
else
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
    head -n 1) || gpu=""
  if [ -z "$gpu" ]; then
    row "GPU" "FAIL" "nvidia-smi sees no GPU"
    failed=1
    summary
  fi
fi
row "GPU" "ok" "$gpu"
if ! torch_info=$("$python" -c 'import torch, os
print(torch.utils.cmake_prefix_path)
print(torch.__version__, "cuda", torch.version.cuda)
try:
    import nvidia.nccl as n; print(os.path.dirname(n.__file__) if n.__file__ else list(n.__path__)[0])
except Exception:
    print("")' 2>&1); then
  row "PyTorch" "FAIL" "$python cannot import torch: ${torch_info//$'\n'/ }"
  failed=1
  summary
fi
torch_prefix=$(sed -n 1p <<<"$torch_info")
nccl_dir=$(sed -n 3p <<<"$torch_info")
row "PyTorch" "ok" "$(sed -n 2p <<<"$torch_info")"

# --- build ---------------------------------------------------------------------------------
# NCCL: the toolkit's when it has one, else the one PyTorch's wheel brings (nvidia-nccl-cu*).
nccl_args=()
if [ ! -f /usr/local/cuda/include/nccl.h ] && [ -n "$nccl_dir" ] && [ -f "$nccl_dir/include/nccl.h" ]; then
  nccl_libs=("$nccl_dir"/lib/libnccl.so*)
  nccl_lib=${nccl_libs[0]}
  nccl_args=(-DLOOM_NCCL_LIBRARY="$nccl_lib" -DCMAKE_CXX_FLAGS="-I$nccl_dir/include")
fi
build_start=$(date +%s)
if run "$log_dir/configure.log" cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLOOM_WITH_CUDA=ON -DLOOM_WITH_GRPC=OFF -DLOOM_BUILD_BENCHMARKS=OFF \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CUDA_ARCHITECTURES=90 "${nccl_args[@]}" &&
  run "$log_dir/build.log" cmake --build "$build_dir" --target loom_gpu_tests gpt -j "$(nproc)"; then
  row "build" "ok" "$(( $(date +%s) - build_start )) s against $torch_prefix"
else
  missing=$(grep -hoE "Could NOT find [A-Za-z0-9_]+|Could not find a package configuration file provided by \"[^\"]+\"|[a-z0-9_/.-]+\.h: No such file" \
    "$log_dir"/configure.log "$log_dir"/build.log 2>/dev/null | sort -u | head -n 5 | tr '\n' ';')
  row "build" "FAIL" "see $log_dir/build.log ${missing:+(missing: $missing)}"
  failed=1
  summary
fi

# --- GPU tests -------------------------------------------------------------------------------
tests_start=$(date +%s)
if run "$log_dir/ctest.log" ctest --test-dir "$build_dir" -L gpu --output-on-failure -V --timeout 300; then
  result="ok"
else
  result="FAIL"
  failed=1
fi
counts=$(grep -E "tests passed|tests failed" "$log_dir/ctest.log" 2>/dev/null | tail -n 1)
skipped=$(grep -c "\[  SKIPPED \]" "$log_dir/ctest.log" 2>/dev/null || true)
row "GPU tests (ctest -L gpu)" "$result" "${counts:-dry run}, $(( $(date +%s) - tests_start )) s${skipped:+, $skipped skip lines}"
peak=$(grep -ho "gpu-check: device .*" "$log_dir/ctest.log" 2>/dev/null | head -n 1)
row "bf16 matmul peak" "${peak:+ok}" "${peak#gpu-check: }"

# --- GPT-2 124M for $seconds s ----------------------------------------------------------------
run_dir=$build_dir/gpt2-124m-check
if [ "$dry_run" != 1 ] && [ ! -f data/kjv-train-bpe/manifest.json ]; then
  row "GPT-2 124M, ${seconds} s" "skip" "no data/kjv-train-bpe: run tools/run-gpt.sh on any machine, carry data/"
else
  rm -rf "$run_dir"
  # SIGINT stops the Trainer cleanly; metrics.jsonl holds the smoothed tokens/s and MFU.
  run "$log_dir/gpt.log" timeout -s INT -k 30 "$seconds" "$build_dir/examples/gpt" \
    --config=examples/gpt/configs/gpt2-124m.toml --run.device=cuda --run.dir="$run_dir" \
    --train.steps=100000 --train.log_every=2 --train.checkpoint_every=0
  status=$?
  metrics=$run_dir/metrics.jsonl
  if [ "$dry_run" = 1 ]; then
    row "GPT-2 124M, ${seconds} s" "dry" "not run"
  elif [ -s "$metrics" ]; then
    figures=$("$python" - "$metrics" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
last = rows[-1]
mfu = last.get("mfu_smoothed")
print("step %d, %.0f tokens/s, MFU %s (peak %.0f TFLOP/s, %s), loss %.3f" % (
    last["step"], last["tokens_per_s_smoothed"],
    "%.1f%%" % (100 * mfu) if mfu is not None else "n/a",
    last["peak_flops"] / 1e12, last["peak_source"], last["loss"]))
PY
)
    row "GPT-2 124M, ${seconds} s" "ok" "$figures"
  else
    row "GPT-2 124M, ${seconds} s" "FAIL" "exit $status, no metrics: see $log_dir/gpt.log"
    failed=1
  fi
fi
summary
