#!/usr/bin/env bash
# The rule of 2026-12-05, step 3: the price (prefill time, prefill peak, decode step over snapkv's) of the presses it
# adds to the pool that no record of at least 3 rounds prices, at r = 0.5 and 0.9 (a press is held to its dearest
# row), one thread, 4096 tokens, each press and round in a fresh process.
#   sh results/bench/run-price-round4.sh [0.5|0.9 ...]  -> results/bench/price-round4/r<ratio>/price.jsonl
PY="${PY:-.venv/bin/python}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
PRESSES=${PRESSES:-"snapkv cross_kvzip_block1_a50_toprest_ragged cross_kvzip_block1_a75_toprest_ragged adakv_snapkv_ragged topk_gate_ragged"}
for r in ${@:-0.5 0.9}; do
  $PY -m evaluation.bench price --length 4096 --ratio $r --repeats 3 --threads 1 --presses $PRESSES \
    --out results/bench/price-round4/r$r || exit 1
done
