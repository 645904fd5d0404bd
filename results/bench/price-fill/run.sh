#!/usr/bin/env bash
# The fill presses' price (the dated entry of 2026-12-06 06:25 UTC in docs/research/history.md): one thread, r = 0.5,
# 3 rounds, each press and round in a fresh process, side by side with snapkv, RECOMMENDED and topk_gate_ragged.
# 4096-alone: the same at 4096 with the four presses the issue names only, on a quiet machine (load below 1).
#   sh results/bench/price-fill/run.sh 4096|4096-alone|8192
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
case "$1" in
4096) $PY -m evaluation.bench price --length 4096 --ratio 0.5 --repeats 3 --threads 1 \
  --presses snapkv topk_gate_profile_a25_minh256_ragged topk_gate_profile_a50_minh256_ragged \
    topk_gate_profile_a75_minh256_ragged topk_gate_ragged cross_kvzip_block1_a50_toprest_ragged \
  --out results/bench/price-fill/n4096-r0.5 ;;
4096-alone) $PY -m evaluation.bench price --length 4096 --ratio 0.5 --repeats 3 --threads 1 \
  --presses snapkv topk_gate_profile_a25_minh256_ragged topk_gate_ragged cross_kvzip_block1_a50_toprest_ragged \
  --out results/bench/price-fill/n4096-r0.5-alone ;;
8192) $PY -m evaluation.bench price --length 8192 --ratio 0.5 --repeats 3 --threads 1 \
  --presses snapkv ${PRESSES:-topk_gate_profile_a25_minh256_ragged} topk_gate_ragged cross_kvzip_block1_a50_toprest_ragged \
  --out results/bench/price-fill/n8192-r0.5 ;;
*) echo "usage: sh results/bench/price-fill/run.sh 4096|4096-alone|8192"; exit 2 ;;
esac
