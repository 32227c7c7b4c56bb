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
  bible-kjv bible-kjv-text dataset-fashion-mnist
  python3-torch python3-numpy
  openssl  # the TLS tests make their certificates with it
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${#missing[@]} missing package(s): ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
