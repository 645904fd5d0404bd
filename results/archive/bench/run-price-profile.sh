#!/usr/bin/env bash
# The price (prefill time, prefill peak, decode step over snapkv's) of the fast press with the learned per-head
# budget profile (topk_gate_profile_ragged), side by side with snapkv, RECOMMENDED
# (cross_kvzip_block1_a50_toprest_ragged) and the gate's global top (topk_gate_ragged), one thread, each press and
# round in a fresh process, 3 rounds.
#   sh results/archive/bench/run-price-profile.sh LENGTH RATIO...  -> results/archive/bench/price-profile/n<length>-r<ratio>/price.jsonl
PY="${PY:-.venv/bin/python}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
PRESSES=${PRESSES:-"snapkv cross_kvzip_block1_a50_toprest_ragged topk_gate_ragged topk_gate_profile_ragged"}
n=${1:-4096}; shift
for r in ${@:-0.5 0.9}; do
  $PY -m evaluation.bench price --length $n --ratio $r --repeats 3 --threads 1 --presses $PRESSES \
    --out results/archive/bench/price-profile/n$n-r$r || exit 1
done
