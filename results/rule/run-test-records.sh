#!/usr/bin/env bash
# The records issue: the test runs that the round-2 test tables lacked. Resumable: a rerun continues where it
# stopped. Every press of the round-2 test pool on recall's 16 added test windows (9-24 of the order; round 1's
# 8 are in results/recall/test-1024*), the prose pool completed on 23 windows, and RECOMMENDED_PROSE's test runs.
#   sh results/rule/run-test-records.sh recall-added|recall-prose-pick|prose-pool|prose-prose-pick|ruler-prose-pick
set -u
cd "$(dirname "$0")/../.."
PY=".venv/bin/python"
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
RECALL="$PY -m evaluation recall run --split test --seeds 0 1 2 --ratios 0.5 0.75"
PROSE="$PY -m evaluation prose run --split test --context 1024 --seeds 0 1 2 --max-per-essay 1 --max-windows 23 --threads 1 --ratios 0.5 0.75"
PICK2="cross_kvzip_block1_a75_mix50_layers"  # round 2's RECOMMENDED_PROSE
POOL="h2o snapkv tova keydiff expected_attention topk_keydiff_block8 hybrid_keydiff_block8_a90 prob_min_h_priority
  prob_min_h_priority_head prob_uniform_priority_head kvzip topk_kvzip_layers cross_kvzip_block8_a50_layers"
case "$1" in
recall-added)       # the 16 windows no baseline had run on
  $RECALL --max-windows 24 --skip-windows 8 --presses $POOL --out results/recall/test-1024-added ;;
recall-prose-pick)  # RECOMMENDED_PROSE on all 24 windows
  $RECALL --max-windows 24 --presses $PICK2 --out results/archive/recall/test-1024-prose-pick ;;
prose-pool)         # kvzip, topk_kvzip_layers, topk_keydiff_block8 on prose's 23 test windows (resumes round 2's stopped run)
  $PROSE --presses kvzip topk_kvzip_layers topk_keydiff_block8 --out results/prose/test-1024-round2 ;;
prose-prose-pick)   # RECOMMENDED_PROSE on prose's 23 test windows (its first 4 are in results/prose/test-1024-round2)
  $PROSE --presses $PICK2 --out results/prose/test-1024-prose-pick ;;
ruler-prose-pick)   # RECOMMENDED_PROSE on RULER's 32 test examples (8 were run in round 2; the store resumes)
  $PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks niah_single_1 niah_single_2 \
    niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --seeds 0 1 2 \
    --decode-batch 48 --ratios 0.5 0.75 --presses $PICK2 --out results/archive/test/round2-ruler-1024-pick2 ;;
esac
