#!/usr/bin/env bash
# Installs the built Loom into a temporary prefix, builds tests/consumer against the installed
# package with find_package(loom), and runs it. Run by ctest (test "consumer.installed_package").
set -euo pipefail
build_dir=$1
source_dir=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/loom-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$source_dir" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  "${launcher[@]}" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
out=$(cd "$work" && "$work/build/consumer" --consumer.greeting=hi --log.to_file=false)
echo "$out"
grep -q "consumer: hi from rank 0 of 1" <<< "$out"
