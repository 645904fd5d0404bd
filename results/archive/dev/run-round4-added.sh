#!/usr/bin/env bash
# The rule of 2026-12-05 (docs/research/rule-2026-12-05.md), step 2: the per-head allocations on the ragged cache
# that had no development record yet (AdaKV over snapkv's scores, the gate per head), on the three development
# splits at r = 0.5 / 0.75 / 0.9 (deterministic presses: seed 0). Resumable: a rerun continues where it stopped.
#   sh results/archive/dev/run-round4-added.sh ruler|prose|recall|all
PY=${PY:-.venv/bin/python}
PRESSES=${PRESSES:-"adakv_snapkv_ragged topk_gate_ragged"}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
run() {
case "$1" in
ruler) $PY -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses ${PRESSES} --out results/archive/dev/round4-added-ruler-1024 ;;
prose) $PY -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-round4-added ;;
recall) $PY -m evaluation recall run --split dev --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-windows 12 --no-report --out results/archive/recall/dev-1024-round4-added ;;
all) run ruler && run prose && run recall ;;
*) echo "usage: sh results/archive/dev/run-round4-added.sh ruler|prose|recall|all"; exit 2 ;;
esac
}
run "$1"
