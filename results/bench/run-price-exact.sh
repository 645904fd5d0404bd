#!/usr/bin/env bash
# The exact KVzip presses with KVzip's score from the reconstruction's own attention (kvzip_fused), priced beside
# snapkv and kvpress's own KVzipPress in the same run: prefill time, prefill peak, decode step over snapkv's and the
# parts of the prefill, one thread, r = 0.5, 3 rounds, each press and round in a fresh process.
#   sh results/bench/run-price-exact.sh [4096|8192 ...]  -> results/bench/price-exact/n<length>/price.jsonl
PY="${PY:-.venv/bin/python}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
PRESSES=${PRESSES:-"snapkv kvpress_kvzip topk_kvzip_global cross_kvzip_block1_a50_toprest_ragged"}
for n in ${@:-4096 8192}; do
  $PY -m evaluation.bench price --length $n --ratio 0.5 --repeats 3 --threads 1 --presses $PRESSES \
    --out results/bench/price-exact/n$n || exit 1
done
