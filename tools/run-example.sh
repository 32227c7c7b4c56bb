#!/usr/bin/env bash
# Quick start, command one: installs what is missing (apt), builds Loom, turns the images
# Debian's dataset-fashion-mnist ships into Loom datasets (once) and trains the bundled
# Fashion-MNIST example on them with `loom run` on 2 ranks, then prints the test accuracy.
# Arguments are config
# overrides, e.g. tools/run-example.sh --train.epochs=3
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
LOOM_TARGETS="fashion_mnist loom_cli" tools/build.sh -DLOOM_WITH_CUDA=OFF
for split in train test; do
  [ -f "data/fashion-mnist-$split/manifest.json" ] ||
    build/tools/loom/loom data build fashion-mnist --split "$split" --out "data/fashion-mnist-$split"
done
# Two ranks with data parallelism (DDP); a fresh run each time (the Trainer would otherwise
# resume from the run directory's last checkpoint).
rm -rf runs/fashion_mnist
build/tools/loom/loom run --nproc-per-node 2 --run-dir runs/fashion_mnist -- \
  build/examples/fashion_mnist --config=examples/fashion_mnist/config.toml "$@"
echo "run-example: result in runs/fashion_mnist/result.json: $(cat runs/fashion_mnist/result.json)"
