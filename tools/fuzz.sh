#!/usr/bin/env bash
# Loom's fuzzers: one libFuzzer target per parser of untrusted bytes (tests/fuzz/*.cpp), built
# with clang under ASan and UBSan.
#
#   tools/fuzz.sh TARGET SECONDS   build, replay TARGET's regression inputs, then fuzz it
#   tools/fuzz.sh all SECONDS      every target in turn (what CI runs, 30 s each)
#   tools/fuzz.sh list             the targets
#
# Only the parser under test (and the target) is compiled here, instrumented; the rest of Loom
# comes from the main build's libloom.so ($LOOM_BUILD_DIR, default build/: run tools/build.sh
# first). Seeds are in tests/fuzz/corpus/TARGET (read only); what the fuzzer finds new goes to
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
  [flight_dump]="src/comm/flight_recorder.cpp tools/loom/flight_diff.cpp"
  [token_shard]=src/data/shard_format.cpp
  [record_shard]=src/data/shard_format.cpp
  [safetensors]=src/ckpt/safetensors.cpp
  [torch_file]=src/ckpt/torch_file.cpp
  [coordinator_rpc]=src/control/membership.cpp
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
if [[ $target == all ]]; then
  for t in $(printf '%s\n' "${!parser[@]}" | sort); do "$0" "$t" "$seconds"; done
  exit 0
fi
[[ -n ${parser[$target]:-} ]] || { echo "tools/fuzz.sh: no target '$target'" >&2; usage; }

build=${LOOM_BUILD_DIR:-build}
lib=$build/src/libloom.so
[[ -f $lib ]] || { echo "tools/fuzz.sh: $lib is missing: run tools/build.sh first" >&2; exit 1; }
command -v clang++ > /dev/null || { echo "tools/fuzz.sh: clang++ is missing: tools/install-deps.sh" >&2; exit 1; }

out=build-fuzz
# Leaks inside third-party libraries that Loom cannot fix, each explained in the file.
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0"
mkdir -p "$out/obj" "$out/corpus/$target" "$out/crashes"
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
# toml++ header-only, so that the TOML parser itself is instrumented too.
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -D_GLIBCXX_USE_CXX11_ABI=1 -DTOML_HEADER_ONLY=1
  -DLOOM_VERSION=\"fuzz\" -Iinclude -Isrc -Itests/fuzz -Itools/loom -I"$build/src/proto"
  -isystem /usr/include/torch/csrc/api/include
  -Wall -Wno-unused-parameter)
binary=$out/fuzz_$target
source=tests/fuzz/$target.cpp
read -r -a parser_sources <<< "${parser[$target]}"
stale=false
for f in "$source" "${parser_sources[@]}" "$lib" tests/fuzz/fuzz.h; do
  if [[ ! -x $binary || $binary -ot $f ]]; then stale=true; fi
done
if $stale; then
  echo "tools/fuzz.sh: building $binary"
  objects=()
  for f in "${parser_sources[@]}"; do
    objects+=("$out/obj/$target.$(basename "$f" .cpp).o")
    # shellcheck disable=SC2086
    clang++ "${flags[@]}" $sanitize -fsanitize=fuzzer-no-link -c "$f" -o "${objects[-1]}"
  done
  # shellcheck disable=SC2086
  clang++ "${flags[@]}" $sanitize -fsanitize=fuzzer "$source" "${objects[@]}" \
    "$lib" -Wl,-rpath,"$(realpath "$build/src")" -ltorch_cpu -lc10 -lprotobuf -pthread \
    -o "$binary"
fi

# The regression inputs first: each must pass.
regressions=tests/fuzz/regressions/$target
if compgen -G "$regressions/*" > /dev/null; then
  echo "tools/fuzz.sh: $target: replaying $(find "$regressions" -type f | wc -l) regression input(s)"
  "$binary" "$regressions"/* > "$out/$target.regressions.log" 2>&1 ||
    { tail -40 "$out/$target.regressions.log"; echo "tools/fuzz.sh: $target: a regression input fails" >&2; exit 1; }
fi
echo "tools/fuzz.sh: $target: fuzzing for $seconds s"
# New inputs go to the first directory; the seeds (when the target has any) are only read.
corpora=("$out/corpus/$target")
seeds=tests/fuzz/corpus/$target
[[ -d $seeds ]] && corpora+=("$seeds")
log=$out/$target.log
if ! "$binary" -seed="${LOOM_FUZZ_SEED:-0}" -max_total_time="$seconds" -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$out/crashes/$target-" "${corpora[@]}" > "$log" 2>&1; then
  tail -60 "$log"
  echo "tools/fuzz.sh: $target: the fuzzer found a failure; its input is in $out/crashes/" >&2
  exit 1
fi
grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$log" | tr '\n' ' ' | sed "s/^/tools\/fuzz.sh: $target: /"
seed_count=0
[[ -d $seeds ]] && seed_count=$(find "$seeds" -type f | wc -l)
echo "corpus $(find "$out/corpus/$target" -type f | wc -l) new + $seed_count seeds"
