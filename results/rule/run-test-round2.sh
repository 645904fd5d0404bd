#!/usr/bin/env bash
# Issue 26, round 2 (docs/recommendation-rule.md, "Round 2", written 19:04 UTC before any round-2 result):
# the enlarged test split for round 1's picks and the baselines. Resumable: a rerun continues where it stopped.
#   sh results/rule/run-test-round2.sh ruler1024|prose|recall|ruler2048 [N2048, default 8]
#   CANDIDATES="a b" sh results/rule/run-test-round2.sh cand1024|cand-prose|cand-recall|cand2048   round 2's picks
set -u
cd "$(dirname "$0")/../.."
PY=".venv/bin/python"
export PYTHONPATH=$PWD
CANDIDATES=${CANDIDATES:-}
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
R1024="$PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks $TASKS --seeds 0 1 2 --decode-batch 48 --ratios 0.25 0.5 0.75"
R2048="$PY -m evaluation run --context-length 2048 --data-seed 1 --n-examples ${2:-8} --tasks $TASKS --seeds 0 1 2 --decode-batch 48 --ratios 0.25 0.5 0.75"
PROSE="$PY -m evaluation prose run --split test --context 1024 --seeds 0 1 2 --max-per-essay 1 --max-windows 23 --threads 1"
RECALL="$PY -m evaluation recall run --split test --seeds 0 1 2 --max-windows 24"
PICKS="topk_kvzip_layers cross_kvzip_block8_a50_layers kvzip prob_uniform_priority_head"
PICK2="cross_kvzip_block1_a75_mix50_layers"  # round 2's RECOMMENDED_PROSE (dev, 20:55 UTC)
BASE="h2o snapkv tova keydiff expected_attention topk_keydiff_block8 hybrid_keydiff_block8_a90 prob_min_h_priority prob_min_h_priority_head"
case "$1" in
ruler1024)  # round 1's 8 examples are in regime-ruler-1024(-cand); the baselines' 32 in results/archive/test/ruler-1024 etc.
  $R1024 --presses $PICKS h2o snapkv --out results/archive/test/round2-ruler-1024
  $R1024 --ratios 0.25 --presses prob_min_h_priority prob_min_h_priority_head --out results/archive/test/round2-ruler-1024 ;;
prose)      # 23 windows; the baselines at r = 0.5 / 0.75 are in results/prose/test-1024
  $PROSE --ratios 0.25 0.5 0.75 --presses $PICKS $PICK2 topk_keydiff_block8 --out results/prose/test-1024-round2
  $PROSE --ratios 0.25 --presses h2o snapkv tova keydiff expected_attention prob_min_h_priority prob_min_h_priority_head \
    hybrid_keydiff_block8_a90 --out results/prose/test-1024-round2 ;;
recall)
  $RECALL --ratios 0.25 0.5 0.75 --presses $PICKS $PICK2 $BASE --out results/recall/test-1024-round2 ;;
ruler2048)  # round 2's RECOMMENDED and RECOMMENDED_RETRIEVAL against the best top-k at 2048 tokens (compute: one example per task)
  $R2048 --presses topk_kvzip_widest topk_kvzip_ragged_fit topk_keydiff_block8 --out results/archive/test/round2-ruler-2048 ;;
cand1024) $R1024 --presses $CANDIDATES --out results/archive/test/round2-ruler-1024-cand ;;
cand-prose) $PROSE --ratios 0.25 0.5 0.75 --presses $CANDIDATES --out results/prose/test-1024-round2-cand ;;
cand-recall) $RECALL --ratios 0.25 0.5 0.75 --presses $CANDIDATES --out results/recall/test-1024-round2-cand ;;
cand2048) $R2048 --presses $CANDIDATES --out results/test/round2-ruler-2048-cand ;;
esac
