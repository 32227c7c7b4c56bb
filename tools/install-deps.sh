#!/usr/bin/env bash
# Installs, with apt, every Debian package Loom builds, tests and runs its examples with.
# Idempotent: only what is missing is installed; a machine that has everything runs no apt.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-pthread
  libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libtomlplusplus-dev libcli11-dev
  libxxhash-dev zlib1g-dev
  libsentencepiece-dev sentencepiece
  libcpp-httplib-dev
  libcurl4-openssl-dev  # remote datasets (http, https, s3)
  libpng-dev libjpeg-dev  # image fields of record datasets (libjpeg-dev is libjpeg-turbo)
  curl                  # the S3 tests upload to s3rver with it
  nginx-light           # the remote-dataset tests serve shards with it on loopback
  prometheus            # the observability test has it scrape a job's /metrics; promtool
  chromium chromium-driver  # the dashboard tests load it in headless Chromium over WebDriver
  tmux                      # the interactive `loom data show` is tested in a tmux pane
  bible-kjv bible-kjv-text dataset-fashion-mnist
  python3-torch python3-numpy
  openssl  # the TLS tests make their certificates with it
  clang libclang-rt-14-dev  # the fuzzers (tools/fuzz.sh): libFuzzer, ASan and UBSan runtimes
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# npm: Debian's nodejs and npm, unless a node with npm is already installed (e.g. NodeSource's).
if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
  echo "install-deps: installing ${#missing[@]} missing package(s): ${missing[*]}"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The S3-compatible server the remote-dataset tests start on loopback (s3rver, from npm),
# pinned by tools/s3rver/package-lock.json.
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ ! -x "$root/tools/s3rver/node_modules/.bin/s3rver" ]; then
  echo "install-deps: installing s3rver from npm into tools/s3rver/node_modules"
  npm ci --prefix "$root/tools/s3rver" --no-audit --no-fund --loglevel=error
fi
echo "install-deps: done"
