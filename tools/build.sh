#!/usr/bin/env bash
# Configures and builds Loom with Ninja (and ccache when present) into $LOOM_BUILD_DIR
# (default build/). Extra arguments go to cmake's configure step, e.g. -DLOOM_WITH_CUDA=OFF.
# Targets to build can be named in $LOOM_TARGETS (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${LOOM_BUILD_DIR:-build}
jobs=${LOOM_JOBS:-$(nproc)}

# Build directories differ only in their path: let ccache share objects between them.
export CCACHE_NOHASHDIR=true
export CCACHE_BASEDIR=$PWD
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-10G}
# Cache translation units that use the precompiled torch header too (ccache manual, "Precompiled headers").
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}

# Line tables only (backtraces, profilers): full debug info (-g) makes every file that includes
# torch about 40% slower to compile here. LOOM_DEBUG_FLAGS=-g for a debugging build.
debug_flags=${LOOM_DEBUG_FLAGS:--g1}
# -O1 for the sanitizer builds (tools/sanitize.sh): faster to compile, still fast enough to run.
opt_flags=${LOOM_OPT_FLAGS:--O2}

start=$(date +%s)
cmake -S . -B "$build_dir" -G Ninja "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$opt_flags $debug_flags -DNDEBUG" \
  "$@" > "$build_dir.configure.log" 2>&1 ||
  { cat "$build_dir.configure.log"; echo "build.sh: cmake configure failed" >&2; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build_dir" -j "$jobs" ${LOOM_TARGETS:+--target $LOOM_TARGETS}
echo "build.sh: $build_dir built in $(( $(date +%s) - start )) s"
