#!/usr/bin/env bash
# Loom's unit tests under sanitizers, each sanitizer in a build directory of its own (Loom's
# code instrumented; libtorch, Gloo and gRPC as Debian ships them):
#
#   tools/sanitize.sh address,undefined   ASan + UBSan (build-asan): every unit test binary
#   tools/sanitize.sh address,undefined --integration
#                                         the same, then the integration tests, whose processes
#                                         (the loom tool, the test programs, the GPT example)
#                                         are ASan builds too: about 18 min more to build from
#                                         a cold cache and 9 min to run, so CI leaves it out
#   tools/sanitize.sh thread              TSan (build-tsan): the multi-threaded areas' binaries
#                                         (collectives, checkpoint writer and I/O queue, reader
#                                         prefetch and remote cache, heartbeat and coordinator,
#                                         subprocesses)
#
# Each test binary runs once, all its tests in one process (one process per test would pay
# the sanitizer's start-up with libtorch again: 5 minutes instead of 1). A report, a leak at
# exit (LeakSanitizer, with ASan) or a failed test fails the run; its log is printed. The
# suppressions (tests/sanitizers/) are for third-party code only, each saying why.
# tools/run-tests.sh calls this for both after the tests (LOOM_SANITIZERS=none skips it).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: tools/sanitize.sh address,undefined [--integration] | tools/sanitize.sh thread" >&2
  exit 2
}
[[ $# -eq 1 || ($# -eq 2 && $1 == address,undefined && $2 == --integration) ]] || usage
mode=$1
integration=false
[[ ${2:-} == --integration ]] && integration=true
case $mode in
  address,undefined)
    dir=build-asan
    areas=(core util data ckpt comm control metrics optim train parallel kernels cli)
    ;;
  thread)
    dir=build-tsan
    areas=(util comm ckpt data control)
    ;;
  *) usage ;;
esac
targets=()
for a in "${areas[@]}"; do targets+=("loom_${a}_tests"); done
# The examples are configured always (so that the cache never flips) and built only for the
# integration tests, which run the GPT example.
$integration && targets+=(loom_integration_tests)

start=$(date +%s)
echo "sanitize.sh: building ${targets[*]} with -fsanitize=$mode into $dir"
LOOM_BUILD_DIR=$dir LOOM_OPT_FLAGS=-O1 LOOM_TARGETS="${targets[*]}" tools/build.sh \
  -DLOOM_WITH_CUDA=OFF -DLOOM_SANITIZE="$mode" -DLOOM_BUILD_BENCHMARKS=OFF \
  -DLOOM_BUILD_EXAMPLES="$([[ $mode == thread ]] && echo OFF || echo ON)"

supp=$PWD/tests/sanitizers
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:print_suppressions=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# ignore_noninstrumented_modules: memcpy and friends called from uninstrumented libraries
# (libstdc++, gRPC, Gloo, libtorch) are not checked: those libraries' own synchronisation is
# invisible to TSan, so it would report their internal hand-offs; Loom's accesses are checked.
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$supp/tsan.supp:print_suppressions=0"

mkdir -p "$dir/logs"
failed=()
for a in "${areas[@]}"; do
  binary=$dir/tests/loom_${a}_tests
  log=$dir/logs/loom_${a}_tests.log
  t0=$(date +%s)
  if "$binary" --gtest_brief=1 > "$log" 2>&1; then
    echo "sanitize.sh: $mode: loom_${a}_tests passed in $(( $(date +%s) - t0 )) s"
  else
    tail -80 "$log"
    echo "sanitize.sh: $mode: loom_${a}_tests FAILED (whole log: $log)" >&2
    failed+=("loom_${a}_tests")
  fi
done
if $integration; then
  log=$dir/logs/loom_integration_tests.log
  t0=$(date +%s)
  if "$dir/tests/loom_integration_tests" --gtest_brief=1 > "$log" 2>&1; then
    echo "sanitize.sh: $mode: loom_integration_tests passed in $(( $(date +%s) - t0 )) s"
  else
    tail -80 "$log"
    echo "sanitize.sh: $mode: loom_integration_tests FAILED (whole log: $log)" >&2
    failed+=(loom_integration_tests)
  fi
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "sanitize.sh: $mode: failed: ${failed[*]}" >&2
  exit 1
fi
echo "sanitize.sh: $mode: every binary passed, $(( $(date +%s) - start )) s in all"
