#!/usr/bin/env bash
# The rule of 2026-12-06 (docs/research/rule-2026-12-06.md), step 7, after the development choice of the history
# page's entry of 2026-12-06 06:47 UTC was committed: the test splits of the rule of 2026-12-05 (RULER 32 examples at
# data seed 1, prose 23 windows, recall 24 windows) at r = 0.5, 0.75 and 0.9, for the pick and the next three fill
# presses by development worst q (deterministic: seed 0), and the fast incumbent with the gate the package ships
# (seeds 0 1 2, replacing its records of 2026-12-05, which were made with an earlier gate). kvpress's masked
# KVzipPress and the other presses of the pool keep their records of 2026-12-05 (results/rule/run-test-round4.sh).
# Resumable: a rerun continues.
#   sh results/rule/run-test-round5.sh ruler|prose|recall
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
NEW="topk_gate_profile_a25_minh256_ragged topk_gate_profile_a50_minh256_ragged topk_gate_profile_a75_minh256_ragged topk_gate_profile_recent25_ragged"
INC="topk_gate_layers_recent25"
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
run() {  # run REGIME PRESSES SEEDS FOLDER-SUFFIX
case "$1" in
ruler)  $PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks $TASKS --seeds $3 \
          --decode-batch 48 --ratios 0.5 0.75 0.9 --presses $2 --out results/test/round5-ruler-1024$4 ;;
prose)  $PY -m evaluation prose run --split test --context 1024 --seeds $3 --max-per-essay 1 --max-windows 23 \
          --threads 1 --no-report --ratios 0.5 0.75 0.9 --presses $2 --out results/prose/test-1024-round5$4 ;;
recall) $PY -m evaluation recall run --split test --seeds $3 --max-windows 24 --no-report --ratios 0.5 0.75 0.9 \
          --presses $2 --out results/recall/test-1024-round5$4 ;;
*) echo "usage: sh results/rule/run-test-round5.sh ruler|prose|recall"; exit 2 ;;
esac
}
run "$1" "$NEW" "0" "" && run "$1" "$INC" "0 1 2" "-incumbent"
