#!/usr/bin/env bash
# Round 3 (docs/recommendation-rule.md, "Round 3", written 2026-12-02 14:37 UTC before any round-3 result): the
# test splits of round 2 (RULER 32 examples at data seed 1, prose 23 windows, recall 24 windows) at r = 0.5, 0.75
# and 0.9, for the round-3 presses chosen on dev (CANDIDATES) and the pool's references at r = 0.9 (their r = 0.5
# and 0.75 records are round 2's). Resumable: a rerun continues where it stopped.
#   CANDIDATES="a b" sh results/rule/run-test-round3.sh ruler|prose|recall     the dev picks, r = 0.5 0.75 0.9
#   sh results/rule/run-test-round3.sh ruler-base|prose-base|recall-base        the references
#   As run (docs/recommendation-rule.md, "Round 3 as applied"):
#     CANDIDATES="cross_kvzip_block1_a75_toprest_widest cross_kvzip_block1_a50_toprest_widest topk_gate_widest" ... ruler
#     CANDIDATES="cross_kvzip_block1_a75_widest" ... ruler-sampled
#     CANDIDATES="<the four>" ... prose, recall
set -u
cd "$(dirname "$0")/../.."
PY=".venv/bin/python"
export PYTHONPATH=$PWD
CANDIDATES=${CANDIDATES:-}
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
RULER="$PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks $TASKS --seeds 0 1 2 --decode-batch 48"
PROSE="$PY -m evaluation prose run --split test --context 1024 --seeds 0 1 2 --max-per-essay 1 --max-windows 23 --threads 1 --no-report"
RECALL="$PY -m evaluation recall run --split test --seeds 0 1 2 --max-windows 24 --no-report"
BASE="snapkv h2o topk_keydiff_block8 topk_kvzip_widest"  # deterministic; on RULER at every ratio (the earlier records carry no bias bytes)
case "$1" in
ruler)  $RULER --ratios 0.5 0.75 0.9 --presses $CANDIDATES --out results/test/round3-ruler-1024-cand ;;
ruler-sampled)  # the sampling presses (3 seeds), in their own folder so that it runs beside "ruler"
        $RULER --ratios 0.5 0.75 0.9 --presses $CANDIDATES prob_min_h --out results/test/round3-ruler-1024-cand-s ;;
prose)  $PROSE --ratios 0.5 0.75 0.9 --presses $CANDIDATES --out results/prose/test-1024-round3-cand ;;
recall) $RECALL --ratios 0.5 0.75 0.9 --presses $CANDIDATES prob_min_h --out results/recall/test-1024-round3-cand ;;
ruler-base)  $RULER --ratios 0.5 0.75 0.9 --presses $BASE --out results/test/round3-ruler-1024 ;;
prose-base)  $PROSE --ratios 0.9 --presses $BASE prob_min_h --out results/prose/test-1024-round3 ;;
recall-base) $RECALL --ratios 0.9 --presses $BASE --out results/recall/test-1024-round3 ;;
*) echo "usage: sh results/rule/run-test-round3.sh ruler|ruler-sampled|prose|recall|ruler-base|prose-base|recall-base"; exit 2 ;;
esac
