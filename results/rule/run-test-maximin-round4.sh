#!/usr/bin/env bash
# The rule of 2026-12-05 (docs/research/rule-2026-12-05.md) on the test splits, r = 0.5, 0.75 and 0.9: RULER 32
# examples (data seed 1), prose 23 windows, recall 24 windows. The pool is round 3's test pool and the five presses
# the development choice sent (results/rule/run-test-round4.sh); kvpress's masked kvzip is not in it (a reference:
# it frees nothing). Bytes and price as on the development splits (run-dev-maximin-round4.sh). Then the presses side
# by side with the reference, in each regime's own unit, and the paired differences the rule reports.
#   sh results/rule/run-test-maximin-round4.sh  -> results/rule/test-maximin-round4.md (+ .csv), test-targets-round4.md,
#   test-maximin-round4-fast.md
PY=".venv/bin/python"
export PYTHONPATH=$PWD
P=results/bench
NEW="cross_kvzip_block1_a50_toprest_ragged topk_kvzip_global topk_gate_layers_recent25 cross_kvzip_block1_a75_toprest_ragged topk_gate_ragged"
OLD="snapkv h2o topk_keydiff_block8 prob_min_h topk_kvzip_widest topk_gate_widest cross_kvzip_block1_a75_widest cross_kvzip_block1_a50_toprest_widest cross_kvzip_block1_a75_toprest_widest"
RULER="results/test/round3-ruler-1024 results/test/round3-ruler-1024-cand results/test/round3-ruler-1024-cand-s results/test/round4-ruler-1024"
PROSE="results/prose/test-1024 results/prose/test-1024-round2 results/prose/test-1024-round2-cand results/prose/test-1024-round3 results/prose/test-1024-round3-cand results/prose/test-1024-round4"
RECALL="results/recall/test-1024 results/recall/test-1024-added results/recall/test-1024-round2 results/recall/test-1024-round2-cand results/recall/test-1024-round3 results/recall/test-1024-round3-cand results/recall/test-1024-round4"
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 0.9 --fast --decode \
  --price $P/price-floor/price.jsonl $P/price-ragged/r0.5/price.jsonl $P/price-ragged/r0.9/price.jsonl \
    $P/price-fast/price.jsonl $P/price-round4/r0.5/price.jsonl $P/price-round4/r0.9/price.jsonl $P/price-round3/price.jsonl \
  --ruler $RULER --prose $PROSE --recall $RECALL --only $OLD $NEW \
  --bytes results/bytes/dev-round3/*-float32.jsonl results/bytes/dev-round3/*-bfloat16.jsonl \
    results/bytes/dev-round4/*-float32.jsonl results/bytes/dev-round4/*-bfloat16.jsonl \
  --out results/rule/test-maximin-round4.md
$PY -m experiments.ragged_targets --split test --ratios 0.5 0.75 0.9 \
  --ruler $RULER results/test/round4-ruler-1024-ref --prose $PROSE results/prose/test-1024-round4-ref \
  --recall $RECALL results/recall/test-1024-round4-ref \
  --presses full kvzip topk_kvzip_global cross_kvzip_block1_a50_toprest_ragged cross_kvzip_block1_a75_toprest_ragged \
    topk_gate_layers_recent25 topk_gate_ragged cross_kvzip_block1_a75_toprest_widest topk_kvzip_widest h2o snapkv \
  --pairs topk_kvzip_global:kvzip cross_kvzip_block1_a50_toprest_ragged:cross_kvzip_block1_a75_toprest_widest \
    cross_kvzip_block1_a50_toprest_ragged:topk_kvzip_widest topk_kvzip_global:topk_kvzip_widest \
    topk_gate_layers_recent25:topk_gate_widest \
  --out results/rule/test-targets-round4.md
# RECOMMENDED_FAST's worst q in round 3's pool plus its own rows (the figure the issue's target of 0.45 reads)
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 0.9 --fast --decode \
  --price $P/price-floor/price.jsonl $P/price-fast/price.jsonl $P/price-round3/price.jsonl \
  --ruler $RULER --prose $PROSE --recall $RECALL --only $OLD topk_gate_layers_recent25 \
  --bytes results/bytes/dev-round3/*-float32.jsonl results/bytes/dev-round3/*-bfloat16.jsonl \
  --out results/rule/test-maximin-round4-fast.md
