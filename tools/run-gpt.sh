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
if [ ! -f data/kjv-val-bpe/manifest.json ]; then
  mkdir -p data
  # bible prints each chapter as two paragraphs: its title ("Genesis 1") and its verses.
  bible gen1:1-rev22:21 | awk -v train=data/kjv-train.txt -v val=data/kjv-val.txt '
    BEGIN { RS = ""; ORS = "\n\n" }
    { chapter = int((NR + 1) / 2); print > ((chapter % 25 == 0) ? val : train) }'
  [ -f data/kjv-train-bpe/manifest.json ] ||
    "$loom" data build text --input data/kjv-train.txt --vocab-size 4096 --out data/kjv-train-bpe
  "$loom" data build text --input data/kjv-val.txt --tokenizer data/kjv-train-bpe/tokenizer.model \
    --out data/kjv-val-bpe
fi
# Two data-parallel ranks; a fresh run (the Trainer would otherwise resume from the run
# directory's newest checkpoint, which is what a restarted job wants).
rm -rf runs/gpt-tiny
"$loom" run --nproc-per-node 2 --run-dir runs/gpt-tiny -- \
  "$build/examples/gpt" --config=examples/gpt/configs/tiny.toml "$@"
echo "run-gpt: metrics.jsonl, goodput.json, result.json and ckpt/ are in runs/gpt-tiny"
