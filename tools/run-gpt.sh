#!/usr/bin/env bash
# Quick start for text: builds Loom's GPT example and the `loom` tool, turns the King James
# Bible (Debian's bible-kjv) into BPE token datasets once, and trains the tiny GPT config for
# a few minutes on 2 CPU ranks (DDP, `loom run`), with checkpoints, logging loss, throughput
# and MFU, evaluating held-out loss and printing sampled text. Arguments are config overrides, e.g.
#   tools/run-gpt.sh --train.steps=2000            (longer)
#   tools/run-gpt.sh --config=examples/gpt/configs/small.toml
# Data: every 25th chapter is held out for evaluation (data/kjv-val-bpe); the rest is the
# training set (data/kjv-train-bpe); both use the tokenizer trained on the training text.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${LOOM_BUILD_DIR:-build}

tools/install-deps.sh
LOOM_BUILD_DIR=$build LOOM_TARGETS="gpt loom_cli" tools/build.sh -DLOOM_WITH_CUDA=OFF
loom=$build/tools/loom/loom
LOOM_BUILD_DIR=$build tools/kjv-data.sh
# Two data-parallel ranks; a fresh run (the Trainer would otherwise resume from the run
# directory's newest checkpoint, which is what a restarted job wants).
rm -rf runs/gpt-tiny
"$loom" run --nproc-per-node 2 --run-dir runs/gpt-tiny -- \
  "$build/examples/gpt" --config=examples/gpt/configs/tiny.toml "$@"
echo "run-gpt: metrics.jsonl, goodput.json, result.json and ckpt/ are in runs/gpt-tiny"
