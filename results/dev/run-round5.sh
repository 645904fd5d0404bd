#!/usr/bin/env bash
# The rule of 2026-12-06 (docs/research/rule-2026-12-06.md), steps 1-2: the pool on the enlarged development splits
# (RULER 32 examples at data seed 2; prose up to 3 windows per development essay; recall up to 36 windows), at
# r = 0.5 / 0.75 / 0.9, deterministic presses at seed 0. kvpress's masked kvzip runs beside the pool as the
# reference. Resumable: a rerun continues where it stopped. PRESSES overrides the list (the gate presses run once
# the package ships its gate).
#   sh results/dev/run-round5.sh ruler|prose|recall|all
PY=${PY:-.venv/bin/python}
PRESSES=${PRESSES:-"snapkv h2o topk_kvzip_global cross_kvzip_block1_a50_toprest_ragged kvzip"}
TAG=${TAG:-round5}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
run() {
case "$1" in
ruler) $PY -m evaluation run --context-length 1024 --data-seed 2 --n-examples 32 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses ${PRESSES} --out results/dev/${TAG}-ruler-1024-s2 ;;
prose) $PY -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-per-essay 3 --threads 1 --no-report --out results/prose/dev-1024-${TAG} ;;
recall) $PY -m evaluation recall run --split dev --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-windows 36 --no-report --out results/recall/dev-1024-${TAG} ;;
all) run ruler && run prose && run recall ;;
*) echo "usage: sh results/dev/run-round5.sh ruler|prose|recall|all"; exit 2 ;;
esac
}
run "$1"
