#!/usr/bin/env bash
# The rule of 2026-12-06 (docs/research/rule-2026-12-06.md) on the test splits, r = 0.5, 0.75 and 0.9: RULER 32
# examples (data seed 1), prose 23 windows, recall 24 windows. The pool is the test pool of 2026-12-05
# (results/rule/run-test-maximin-round4.sh) and the four fill presses the development choice of 2026-12-06 sent
# (results/rule/run-test-round5.sh), the fast incumbent's records replaced by its rerun with the shipped gate;
# kvpress's masked kvzip is not in it (a reference: it frees nothing). Then the presses side by side with the
# reference, in each regime's own unit, and the paired differences.
#   sh results/rule/run-test-maximin-round5.sh  -> results/rule/test-maximin-round5.md (+ .csv), test-targets-round5.md
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD
P=results/bench
FILL="topk_gate_profile_a25_minh256_ragged topk_gate_profile_a50_minh256_ragged topk_gate_profile_a75_minh256_ragged topk_gate_profile_recent25_ragged"
OLD="snapkv h2o topk_keydiff_block8 prob_min_h topk_kvzip_widest topk_gate_widest cross_kvzip_block1_a75_widest cross_kvzip_block1_a50_toprest_widest cross_kvzip_block1_a75_toprest_widest cross_kvzip_block1_a50_toprest_ragged topk_kvzip_global topk_gate_layers_recent25 cross_kvzip_block1_a75_toprest_ragged topk_gate_ragged"
RULER="results/test/round3-ruler-1024 results/test/round3-ruler-1024-cand results/test/round3-ruler-1024-cand-s results/test/round4-ruler-1024 results/test/round5-ruler-1024 results/test/round5-ruler-1024-incumbent"
PROSE="results/prose/test-1024 results/prose/test-1024-round2 results/prose/test-1024-round2-cand results/prose/test-1024-round3 results/prose/test-1024-round3-cand results/prose/test-1024-round4 results/prose/test-1024-round5 results/prose/test-1024-round5-incumbent"
RECALL="results/recall/test-1024 results/recall/test-1024-added results/recall/test-1024-round2 results/recall/test-1024-round2-cand results/recall/test-1024-round3 results/recall/test-1024-round3-cand results/recall/test-1024-round4 results/recall/test-1024-round5 results/recall/test-1024-round5-incumbent"
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 0.9 --fast --decode \
  --price $P/price-fill/n4096-r0.5/price.jsonl $P/price-floor/price.jsonl $P/price-ragged/r0.5/price.jsonl \
    $P/price-ragged/r0.9/price.jsonl $P/price-fast/price.jsonl $P/price-round4/r0.5/price.jsonl \
    $P/price-round4/r0.9/price.jsonl $P/price-round3/price.jsonl \
  --ruler $RULER --prose $PROSE --recall $RECALL --only $OLD $FILL \
  --bytes results/bytes/dev-round3/*-float32.jsonl results/bytes/dev-round3/*-bfloat16.jsonl \
    results/bytes/dev-round4/*-float32.jsonl results/bytes/dev-round4/*-bfloat16.jsonl results/bytes/dev-round5-fill/*.jsonl \
  --out results/rule/test-maximin-round5.md
$PY -m experiments.ragged_targets --split test --ratios 0.5 0.75 0.9 \
  --ruler $RULER results/test/round4-ruler-1024-ref --prose $PROSE results/prose/test-1024-round4-ref \
  --recall $RECALL results/recall/test-1024-round4-ref \
  --presses full kvzip $FILL cross_kvzip_block1_a50_toprest_ragged topk_kvzip_global topk_gate_layers_recent25 h2o snapkv \
  --pairs topk_gate_profile_a25_minh256_ragged:cross_kvzip_block1_a50_toprest_ragged \
    topk_gate_profile_a25_minh256_ragged:topk_gate_layers_recent25 topk_gate_profile_a25_minh256_ragged:kvzip \
    topk_gate_profile_a25_minh256_ragged:topk_kvzip_global \
  --out results/rule/test-targets-round5.md
