#!/usr/bin/env bash
# The rule of 2026-12-06 (docs/research/rule-2026-12-06.md), steps 3-4: the fast pool's price on the code that
# ships for the two new presses (the others have records of 3 rounds; one thread, 4096 tokens, r = 0.5, 3 rounds, each press and round in a fresh process, snapkv timed in the
# same run).   sh results/bench/price-round5/run.sh
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
$PY -m evaluation.bench price --length 4096 --ratio 0.5 --repeats 3 --threads 1 \
  --presses snapkv topk_gate_profile_ragged topk_gate_profile_layers_ragged \
  --out results/bench/price-round5/n4096-r0.5
