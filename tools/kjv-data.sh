#!/usr/bin/env bash
# Turns the King James Bible (Debian's bible-kjv) into the GPT example's BPE token datasets,
# once: data/kjv-train-bpe (every chapter but each 25th, with a 4096-piece tokenizer trained on
# it) and data/kjv-val-bpe (each 25th chapter, held out, with the same tokenizer). Needs the
# `loom` tool built ($LOOM_BUILD_DIR, default build/). tools/run-gpt.sh and bench_recovery use it.
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM_BUILD_DIR:-build}/tools/loom/loom
if [ -f data/kjv-val-bpe/manifest.json ]; then exit 0; fi
mkdir -p data
# bible prints each chapter as two paragraphs: its title ("Genesis 1") and its verses.
bible gen1:1-rev22:21 | awk -v train=data/kjv-train.txt -v val=data/kjv-val.txt '
  BEGIN { RS = ""; ORS = "\n\n" }
  { chapter = int((NR + 1) / 2); print > ((chapter % 25 == 0) ? val : train) }'
[ -f data/kjv-train-bpe/manifest.json ] ||
  "$loom" data build text --input data/kjv-train.txt --vocab-size 4096 --out data/kjv-train-bpe
"$loom" data build text --input data/kjv-val.txt --tokenizer data/kjv-train-bpe/tokenizer.model \
  --out data/kjv-val-bpe
