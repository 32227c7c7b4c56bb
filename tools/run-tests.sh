#!/usr/bin/env bash
# Quick start, command two: installs what is missing (apt), builds Loom and runs every test.
#   tools/run-tests.sh              all tests (unit, integration, slow), then the sanitizers
#                                   and the fuzzers
#   tools/run-tests.sh -LE slow     ctest arguments pass through (here: skip the slow ones)
#   tools/run-tests.sh --sanitize=address,undefined   only the unit tests under ASan + UBSan
#   tools/run-tests.sh --sanitize=address,undefined --integration   and the integration tests
#   tools/run-tests.sh --sanitize=thread              only the multi-threaded ones under TSan
# With no arguments, the unit tests then run under each sanitizer in $LOOM_SANITIZERS
# ("address,undefined thread"; "none" skips them; tools/sanitize.sh), and every fuzzer for
# $LOOM_FUZZ_SECONDS (30; 0 skips them).
# Where nvcc exists (/usr/local/cuda) the CUDA configuration (LOOM_WITH_CUDA=ON) is built
# too; its GPU tests run where a GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# Each phase's duration, printed at the end (CI must stay under 40 minutes on 2 cores).
phases=()
phase_start=$start
phase_done() {
  local now
  now=$(date +%s)
  phases+=("$(printf '%5d s  %s' $((now - phase_start)) "$1")")
  phase_start=$now
}

tools/install-deps.sh
phase_done "install-deps"

if [[ ${1:-} == --sanitize=* ]]; then
  exec tools/sanitize.sh "${1#--sanitize=}" "${@:2}"
fi

echo "run-tests: building the CPU configuration (LOOM_WITH_CUDA=OFF)"
tools/build.sh -DLOOM_WITH_CUDA=OFF
phase_done "build, CPU configuration"

if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc > /dev/null; then
  echo "run-tests: building the CUDA configuration (LOOM_WITH_CUDA=ON)"
  # The library, its GPU tests and the example trainers (what a GPU user builds first). Every
  # file but the CUDA ones compiles as in the CPU configuration, so ccache has it already.
  LOOM_BUILD_DIR=build-cuda LOOM_TARGETS="loom loom_gpu_tests fashion_mnist gpt" tools/build.sh \
    -DLOOM_WITH_CUDA=ON -DLOOM_BUILD_BENCHMARKS=OFF
  if nvidia-smi -L > /dev/null 2>&1; then
    ctest --test-dir build-cuda --output-on-failure -L gpu
  else
    echo "run-tests: no GPU visible; the CUDA build compiled and linked, its GPU tests not run"
  fi
  phase_done "build, CUDA configuration"
fi

echo "run-tests: built in $(( $(date +%s) - start )) s; running ctest"
ctest --test-dir build --output-on-failure --timeout 600 -j "$(nproc)" "$@"
phase_done "ctest"
# The unit tests under each sanitizer, when every test ran (no ctest arguments given).
if [ $# -eq 0 ]; then
  for mode in ${LOOM_SANITIZERS:-address,undefined thread}; do
    [ "$mode" = none ] && continue
    echo "run-tests: the unit tests under -fsanitize=$mode (tools/sanitize.sh)"
    tools/sanitize.sh "$mode"
    phase_done "sanitizer $mode: build and unit tests"
  done
fi
# The fuzzers, each for LOOM_FUZZ_SECONDS (30; 0 skips them), when every test ran (no ctest
# arguments given), with a fixed seed (LOOM_FUZZ_SEED, 1) so that a failure reproduces; fuzz
# longer with random seeds by hand (tools/fuzz.sh TARGET SECONDS).
fuzz_seconds=${LOOM_FUZZ_SECONDS:-30}
if [ $# -eq 0 ] && [ "$fuzz_seconds" -gt 0 ]; then
  echo "run-tests: fuzzing every parser for $fuzz_seconds s (tools/fuzz.sh)"
  LOOM_FUZZ_SEED=${LOOM_FUZZ_SEED:-1} tools/fuzz.sh all "$fuzz_seconds"
  phase_done "fuzzers: build and $fuzz_seconds s each"
fi
printf 'run-tests: %s\n' "${phases[@]}"
echo "run-tests: passed in $(( $(date +%s) - start )) s"
