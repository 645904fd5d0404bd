#!/usr/bin/env bash
# The rule of 2026-12-05 (docs/research/rule-2026-12-05.md, written before any result of the presses it adds), step 6:
# the test splits of the rule of 2026-12-02 (RULER 32 examples at data seed 1, prose 23 windows, recall 24 windows) at
# r = 0.5, 0.75 and 0.9, for the presses chosen on the development splits (CANDIDATES, at most 6), then kvpress's masked
# KVzipPress (`kvzip`: kvpress's class, scores and masks unchanged, its scoring memory bounded) as the reference.
# The reference runs in its own folders (*-ref), which it fills whatever the choice. Resumable: a rerun continues.
#   CANDIDATES="a b ..." sh results/rule/run-test-round4.sh ruler|prose|recall
#   CANDIDATES=kvzip sh results/rule/run-test-round4.sh ruler-ref|prose-ref|recall-ref
set -u
cd "$(dirname "$0")/../.."
PY=".venv/bin/python"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
CANDIDATES=${CANDIDATES:?"the presses chosen on the development splits"}
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
R=""; case "$1" in *-ref) R="-ref" ;; esac
case "${1%-ref}" in
ruler)  $PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks $TASKS --seeds 0 1 2 \
          --decode-batch 48 --ratios 0.5 0.75 0.9 --presses $CANDIDATES --out results/test/round4-ruler-1024$R ;;
prose)  $PY -m evaluation prose run --split test --context 1024 --seeds 0 1 2 --max-per-essay 1 --max-windows 23 \
          --threads 1 --no-report --ratios 0.5 0.75 0.9 --presses $CANDIDATES --out results/prose/test-1024-round4$R ;;
recall) $PY -m evaluation recall run --split test --seeds 0 1 2 --max-windows 24 --no-report --ratios 0.5 0.75 0.9 \
          --presses $CANDIDATES --out results/recall/test-1024-round4$R ;;
*) echo "usage: CANDIDATES=... sh results/rule/run-test-round4.sh ruler|prose|recall"; exit 2 ;;
esac
