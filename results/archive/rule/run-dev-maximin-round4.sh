#!/usr/bin/env bash
# The rule of 2026-12-05 (docs/research/rule-2026-12-05.md) on the development splits: round 3's pool, the fast gate
# presses and the presses on the ragged cache, at r = 0.5, 0.75 and 0.9 (RULER 8 examples, prose 7 windows, recall
# 12 windows); bytes of round 3 and of run-dev-bytes-round4.sh; candidates also need a decode step <= 1.10 x snapkv's
# (--decode: price records of at least 3 rounds, each press held to its dearest row); RECOMMENDED_FAST also a
# prefill time and peak <= 1.2 x. kvpress's masked kvzip is left out of the pool (a reference; it frees nothing).
#   sh results/archive/rule/run-dev-maximin-round4.sh  -> results/archive/rule/dev-maximin-round4.md (+ .csv)
PY=".venv/bin/python"
export PYTHONPATH=$PWD
P=results/bench
$PY -m evaluation.report.maximin_table dev --ratios 0.5 0.75 0.9 --fast --decode --drop kvzip \
  --price $P/price-floor/price.jsonl $P/price-ragged/r0.5/price.jsonl $P/price-ragged/r0.9/price.jsonl \
    $P/price-fast/price.jsonl $P/price-round4/r0.5/price.jsonl $P/price-round4/r0.9/price.jsonl $P/price-round3/price.jsonl \
  --ruler results/archive/dev/round3-ruler-1024 results/archive/dev/round3-toprest-ruler-1024 results/archive/dev/fast-ruler-1024 \
    results/archive/dev/ragged-ruler-1024 results/archive/dev/ragged-presses-ruler-1024 results/archive/dev/round4-added-ruler-1024 \
  --prose results/archive/prose/dev-1024-round3 results/archive/prose/dev-1024-round3-toprest results/archive/prose/dev-1024-fast \
    results/archive/prose/dev-1024-ragged results/archive/prose/dev-1024-ragged-presses results/archive/prose/dev-1024-round4-added \
  --recall results/archive/recall/dev-1024-round3 results/archive/recall/dev-1024-round3-toprest results/archive/recall/dev-1024-fast \
    results/archive/recall/dev-1024-ragged results/archive/recall/dev-1024-ragged-presses results/archive/recall/dev-1024-round4-added \
  --bytes results/bytes/dev-round3/*-float32.jsonl results/bytes/dev-round3/*-bfloat16.jsonl \
    results/bytes/dev-round4/*-float32.jsonl results/bytes/dev-round4/*-bfloat16.jsonl \
  --out ${OUT:-results/archive/rule/dev-maximin-round4.md}
