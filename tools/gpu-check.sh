#!/usr/bin/env bash
# On a GPU machine: builds Loom with CUDA against the PyTorch installed there (its libtorch has
# CUDA, unlike Debian's), then runs the GPU-labelled tests (CUDA kernels against their CPU
# references, the NCCL backend at world size 1). Needs the Debian -dev packages of
# tools/install-deps.sh except libtorch; prints what is missing.
#   tools/gpu-check.sh [build-dir]      (default build-gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build-gpu}

nvidia-smi -L || { echo "gpu-check: no GPU visible (nvidia-smi failed)" >&2; exit 1; }
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  { echo "gpu-check: python3 cannot import torch" >&2; exit 1; }
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

start=$(date +%s)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WITH_CUDA=ON \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_BUILD_BENCHMARKS=OFF
cmake --build "$build_dir" --target loom_gpu_tests -j "$(nproc)"
echo "gpu-check: built in $(( $(date +%s) - start )) s"
ctest --test-dir "$build_dir" -L gpu --output-on-failure
