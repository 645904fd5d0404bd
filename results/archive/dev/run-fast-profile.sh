#!/usr/bin/env bash
# Where the fast press loses against KVzip's global top (experiments/fast_profile.py): KVzip's labels of the fitting
# and measuring development contexts (cached under $KVPROB_CACHE/gates/<model key>/labels), the default gate's
# scores, kept-set recall of each row, then the table; `learn` writes the shipped budget profile.
#   sh results/archive/dev/run-fast-profile.sh [labels|learn|measure|ruler|bytes|table|all]
PY="${PY:-.venv/bin/python}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
case "${1:-all}" in
labels) $PY -m experiments.fast_profile measure labels ;;
learn) $PY -m experiments.fast_profile learn ;;
measure) $PY -m experiments.fast_profile measure ;;
ruler) $PY -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses ${PRESSES:-topk_gate_profile_ragged \
  topk_gate_profile_recent10_ragged topk_gate_profile_layers_ragged topk_gate_ragged topk_gate_layers_recent25} \
  --out results/archive/dev/fast-profile-ruler-1024 ;;
bytes) $PY -m evaluation.bench bytes --results results/archive/dev/round3-ruler-1024 results/archive/dev/fast-profile-ruler-1024 \
  --name fast-profile --presses snapkv topk_gate_profile_ragged --ratios 0.5 0.75 0.9 --dtypes float32 bfloat16 \
  --max-examples 2 --out results/archive ;;
table) { $PY -m experiments.fast_profile table && $PY -m experiments.fast_profile quality; } \
  > results/archive/dev/fast-profile/table.md ;;
all) sh "$0" labels && sh "$0" learn && sh "$0" measure && sh "$0" ruler && sh "$0" bytes && sh "$0" table ;;
*) echo "usage: sh results/archive/dev/run-fast-profile.sh labels|learn|measure|ruler|bytes|table|all"; exit 2 ;;
esac
