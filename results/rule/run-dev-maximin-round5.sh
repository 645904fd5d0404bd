#!/usr/bin/env bash
# The rule of 2026-12-06 (docs/research/rule-2026-12-06.md) on the enlarged development splits (RULER 32 examples at
# data seed 2, prose up to 3 windows per essay, recall up to 36 windows; r = 0.5, 0.75, 0.9): the maximin table of
# the round's pool with the fast pool's bounds (--fast --decode: prefill time and peak <= 1.2 x, decode <= 1.10 x
# snapkv's in price records of at least 3 rounds), kvpress's masked kvzip left out of the pool; then the
# no-regression clause against the fast role's incumbent.
#   sh results/rule/run-dev-maximin-round5.sh
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD
P=results/bench
RULER="results/dev/round5-ruler-1024-s2 results/dev/round5-gates-ruler-1024-s2"
PROSE="results/prose/dev-1024-round5 results/prose/dev-1024-round5-gates"
RECALL="results/recall/dev-1024-round5 results/recall/dev-1024-round5-gates"
$PY -m evaluation.report.maximin_table dev --ratios 0.5 0.75 0.9 --fast --decode --drop kvzip \
  --price $P/price-round5/n4096-r0.5/price.jsonl $P/price-exact/n4096/price.jsonl $P/price-fast/price.jsonl \
    $P/price-ragged-peak/r0.5/price.jsonl $P/price-ragged/r0.5/price.jsonl $P/price-round4/r0.5/price.jsonl \
    $P/price-floor/price.jsonl $P/price-round3/price.jsonl \
  --ruler $RULER --prose $PROSE --recall $RECALL \
  --bytes results/bytes/dev-round4/*-float32.jsonl results/bytes/dev-round4/*-bfloat16.jsonl \
    results/archive/bytes/fast-profile/*.jsonl \
  --out results/rule/dev-maximin-round5.md
$PY -m experiments.no_regression --incumbent topk_gate_layers_recent25 \
  --candidates topk_gate_profile_ragged topk_gate_profile_layers_ragged topk_gate_ragged topk_gate_widest \
  --ruler $RULER --prose $PROSE --recall $RECALL --drop kvzip --out results/rule/dev-no-regression-round5.md
