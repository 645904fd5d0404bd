#!/usr/bin/env bash
# The rule of 2026-12-06 (docs/research/rule-2026-12-06.md) with the fill presses of the history page's entry of
# 2026-12-06 06:25 UTC: their bytes on the first 2 contexts of each development regime (float32, bfloat16), then the
# maximin table of the round's pool with them and the no-regression clause against the fast role's incumbent.
#   sh results/rule/run-dev-maximin-round5-fill.sh bytes|table
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
P=results/bench
FILL="topk_gate_profile_a25_minh256_ragged topk_gate_profile_a50_minh256_ragged topk_gate_profile_a75_minh256_ragged topk_gate_profile_recent25_ragged"
RULER="results/dev/round5-ruler-1024-s2 results/dev/round5-gates-ruler-1024-s2 results/dev/round5-fill-ruler-1024-s2"
PROSE="results/prose/dev-1024-round5 results/prose/dev-1024-round5-gates results/prose/dev-1024-round5-fill"
RECALL="results/recall/dev-1024-round5 results/recall/dev-1024-round5-gates results/recall/dev-1024-round5-fill"
case "$1" in
bytes)
  for folders in "$RULER" "$PROSE" "$RECALL"; do
    OMP_NUM_THREADS=1 $PY -m evaluation.bench bytes --results $folders --name dev-round5-fill --presses snapkv $FILL \
      --ratios 0.5 0.75 0.9 --dtypes float32 bfloat16 --max-examples 2 --out results || exit 1
  done ;;
table)
  $PY -m evaluation.report.maximin_table dev --ratios 0.5 0.75 0.9 --fast --decode --drop kvzip \
    --price $P/price-fill/n4096-r0.5/price.jsonl $P/price-round5/n4096-r0.5/price.jsonl \
      $P/price-exact/n4096/price.jsonl $P/price-fast/price.jsonl \
      $P/price-ragged-peak/r0.5/price.jsonl $P/price-ragged/r0.5/price.jsonl $P/price-round4/r0.5/price.jsonl \
      $P/price-floor/price.jsonl $P/price-round3/price.jsonl \
    --ruler $RULER --prose $PROSE --recall $RECALL \
    --bytes results/bytes/dev-round4/*-float32.jsonl results/bytes/dev-round4/*-bfloat16.jsonl \
      results/archive/bytes/fast-profile/*.jsonl results/bytes/dev-round5-fill/*.jsonl \
    --out results/rule/dev-maximin-round5-fill.md
  $PY -m experiments.no_regression --incumbent topk_gate_layers_recent25 \
    --candidates $FILL topk_gate_profile_ragged topk_gate_profile_layers_ragged topk_gate_ragged topk_gate_widest \
    --ruler $RULER --prose $PROSE --recall $RECALL --drop kvzip --out results/rule/dev-no-regression-round5-fill.md ;;
*) echo "usage: sh results/rule/run-dev-maximin-round5-fill.sh bytes|table"; exit 2 ;;
esac
