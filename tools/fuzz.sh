#!/usr/bin/env bash
# Loom's fuzzers: one libFuzzer target per parser of untrusted bytes (tests/fuzz/*.cpp), built
# with clang under ASan and UBSan.
#
#   tools/fuzz.sh TARGET SECONDS   build, replay TARGET's regression inputs, then fuzz it
#   tools/fuzz.sh all SECONDS      every target (what CI runs, 30 s each), as many at once as
#                                  there are cores ($LOOM_JOBS, default nproc)
#   tools/fuzz.sh list             the targets
#
# Only the parser under test (and the target) is compiled here, instrumented; the rest of Loom
# comes from the main build's libloom_internal.a, with what libloom links ($LOOM_BUILD_DIR,
# default build/: run tools/build.sh first). build-fuzz/build.ninja compiles each source once
# for every target that uses it, in parallel. Seeds are in tests/fuzz/corpus/TARGET (read only); what the fuzzer finds new goes to
# build-fuzz/corpus/TARGET. A crash leaves its input in build-fuzz/crashes/ and fails the run:
# fix the parser, then keep the input in tests/fuzz/regressions/TARGET, which every run replays.
# $LOOM_FUZZ_SEED fixes libFuzzer's seed (default: a random one); tools/run-tests.sh passes 1,
# so that a failure in CI reproduces with the same command.
set -euo pipefail
cd "$(dirname "$0")/.."

# target -> the source files of the parser it exercises (space-separated)
declare -A parser=(
  [config]=src/config.cpp
  [dataset_manifest]=src/data/manifest.cpp
  [ckpt_manifest]=src/ckpt/manifest.cpp
  [record]=src/data/shard_format.cpp
  [image]=src/data/image_codec.cpp
  [flight_dump]="src/comm/flight_recorder.cpp tools/loom/flight_diff.cpp"
  [token_shard]=src/data/shard_format.cpp
  [record_shard]=src/data/shard_format.cpp
  [safetensors]=src/ckpt/safetensors.cpp
  [torch_file]=src/ckpt/torch_file.cpp
  [coordinator_rpc]="src/control/membership.cpp src/control/job_metrics.cpp"
)

usage() {
  echo "usage: tools/fuzz.sh TARGET|all SECONDS | tools/fuzz.sh list" >&2
  echo "targets: ${!parser[*]}" >&2
  exit 2
}
[[ $# -ge 1 ]] || usage
if [[ $1 == list ]]; then
  printf '%s\n' "${!parser[@]}" | sort
  exit 0
fi
[[ $# -eq 2 && $2 =~ ^[0-9]+$ ]] || usage
target=$1 seconds=$2
[[ $target == all || -n ${parser[$target]:-} ]] || { echo "tools/fuzz.sh: no target '$target'" >&2; usage; }

build=${LOOM_BUILD_DIR:-build}
archive=$build/src/libloom_internal.a
[[ -f $archive && -f $build/build.ninja ]] ||
  { echo "tools/fuzz.sh: $archive is missing: run tools/build.sh first" >&2; exit 1; }
command -v clang++ > /dev/null || { echo "tools/fuzz.sh: clang++ is missing: tools/install-deps.sh" >&2; exit 1; }
out=build-fuzz
mkdir -p "$out/crashes"

# What libloom links (the main build's link line for it), so that the archive's objects find
# libtorch, Gloo, gRPC and the rest.
link_libraries=$(awk '/^build src\/libloom\.so[^:]*:/ { found = 1 } found && /^  LINK_LIBRARIES = / {
  sub(/^  LINK_LIBRARIES = /, ""); print; exit }' "$build/build.ninja")
[[ -n $link_libraries ]] || { echo "tools/fuzz.sh: no link line for libloom in $build/build.ninja" >&2; exit 1; }

# build-fuzz/build.ninja: one object per source (shared between targets), one binary per target.
{
  sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
  # toml++ header-only, so that the TOML parser itself is instrumented too.
  echo "cxxflags = -std=c++17 -O1 -g -fno-omit-frame-pointer -D_GLIBCXX_USE_CXX11_ABI=1" \
    "-DTOML_HEADER_ONLY=1 '-DLOOM_VERSION=\"fuzz\"' -I$PWD/include -I$PWD/src -I$PWD/tests/fuzz" \
    "-I$PWD/tools/loom -I$PWD/$build/src/proto -isystem /usr/include/torch/csrc/api/include" \
    "-Wall -Wno-unused-parameter $sanitize"
  echo "rule cxx"
  echo "  command = clang++ \$cxxflags -fsanitize=fuzzer-no-link -MD -MF \$out.d -c \$in -o \$out"
  echo "  depfile = \$out.d"
  echo "  deps = gcc"
  echo "  description = fuzz: compiling \$in"
  echo "rule link"
  echo "  command = clang++ \$cxxflags -fsanitize=fuzzer \$in $PWD/$archive $link_libraries -o \$out"
  echo "  description = fuzz: linking \$out"
  for t in "${!parser[@]}"; do
    objects=("obj/$t.o")
    for f in ${parser[$t]}; do objects+=("obj/${f//\//_}.o"); done
    echo "build fuzz_$t: link ${objects[*]} | $PWD/$archive"
  done
  for f in $(printf '%s\n' "${parser[@]}" | tr ' ' '\n' | sort -u); do
    echo "build obj/${f//\//_}.o: cxx $PWD/$f"
  done
  for t in "${!parser[@]}"; do echo "build obj/$t.o: cxx $PWD/tests/fuzz/$t.cpp"; done
} > "$out/build.ninja.new"
cmp -s "$out/build.ninja.new" "$out/build.ninja" || mv "$out/build.ninja.new" "$out/build.ninja"
rm -f "$out/build.ninja.new"
if [[ $target == all ]]; then
  targets=$(printf '%s\n' "${!parser[@]}" | sort)
else
  targets=$target
fi
# (pipefail: the pipeline fails when ninja does.)
# shellcheck disable=SC2046
if ! ninja -C "$out" -j "${LOOM_JOBS:-$(nproc)}" $(printf 'fuzz_%s ' $targets) | sed '/^ninja: Entering/d'; then
  echo "tools/fuzz.sh: building the fuzzers failed" >&2
  exit 1
fi

# Leaks inside third-party libraries that Loom cannot fix, each explained in the file.
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0"

# Replays TARGET's regression inputs, then fuzzes it for $seconds; prints one summary line.
fuzz_one() {
  local target=$1 binary=$out/fuzz_$1
  mkdir -p "$out/corpus/$target"
  # The regression inputs first: each must pass.
  local regressions=tests/fuzz/regressions/$target
  if compgen -G "$regressions/*" > /dev/null; then
    "$binary" "$regressions"/* > "$out/$target.regressions.log" 2>&1 ||
      { tail -40 "$out/$target.regressions.log"; echo "tools/fuzz.sh: $target: a regression input fails" >&2; return 1; }
  fi
  # New inputs go to the first directory; the seeds (when the target has any) are only read.
  local corpora=("$out/corpus/$target") seeds=tests/fuzz/corpus/$target
  [[ -d $seeds ]] && corpora+=("$seeds")
  local log=$out/$target.log
  if ! "$binary" -seed="${LOOM_FUZZ_SEED:-0}" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$out/crashes/$target-" "${corpora[@]}" > "$log" 2>&1; then
    tail -60 "$log"
    echo "tools/fuzz.sh: $target: the fuzzer found a failure; its input is in $out/crashes/" >&2
    return 1
  fi
  local seed_count=0 regression_count=0
  [[ -d $seeds ]] && seed_count=$(find "$seeds" -type f | wc -l)
  [[ -d $regressions ]] && regression_count=$(find "$regressions" -type f | wc -l)
  echo "tools/fuzz.sh: $target: $seconds s," \
    "$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$') runs," \
    "peak $(grep -oE 'stat::peak_rss_mb: *[0-9]+' "$log" | grep -oE '[0-9]+$') MB," \
    "corpus $(find "$out/corpus/$target" -type f | wc -l) new + $seed_count seeds," \
    "$regression_count regression input(s) passed"
}

# Each fuzzer is one process on one core: run as many at once as there are cores.
jobs=${LOOM_JOBS:-$(nproc)}
count=$(wc -w <<< "$targets")
echo "tools/fuzz.sh: fuzzing $count target(s) for $seconds s each, $((count < jobs ? count : jobs)) at a time"
failed=()
running=()
for t in $targets; do
  fuzz_one "$t" &
  running+=("$!:$t")
  if [[ ${#running[@]} -ge $jobs ]]; then
    entry=${running[0]}
    running=("${running[@]:1}")
    wait "${entry%%:*}" || failed+=("${entry#*:}")
  fi
done
for entry in "${running[@]}"; do
  wait "${entry%%:*}" || failed+=("${entry#*:}")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "tools/fuzz.sh: failed: ${failed[*]}" >&2
  exit 1
fi
