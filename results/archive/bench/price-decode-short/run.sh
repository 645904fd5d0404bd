#!/usr/bin/env bash
# The ragged decode step over snapkv's at short and long contexts, after the portable route's 4-d SDPA calls:
# RECOMMENDED (cross_kvzip_block1_a50_toprest_ragged) beside snapkv, one thread, each press and round in a fresh
# process, fp32 and bf16. Resumable: a configuration whose price.jsonl exists is skipped.
#   sh results/archive/bench/price-decode-short/run.sh [LENGTH ...]  -> results/archive/bench/price-decode-short/n<L>-<dtype>-r<ratio>/
cd "$(dirname "$0")/../../../.."
PY="${PY:-.venv/bin/python}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
PRESSES=${PRESSES:-"snapkv cross_kvzip_block1_a50_toprest_ragged"}
for n in ${@:-1024 4096}; do
  if [ "$n" -le 1024 ]; then ratios=${RATIOS:-"0.5 0.75"}; repeats=${REPEATS:-3}; else ratios=${RATIOS:-"0.5"}; repeats=${REPEATS:-2}; fi
  for dtype in ${DTYPES:-float32 bfloat16}; do
    for r in $ratios; do
      out=results/archive/bench/price-decode-short/n$n-$dtype-r$r
      [ -f "$out/price.jsonl" ] && continue
      $PY -m evaluation.bench price --length $n --ratio $r --repeats $repeats --threads 1 --dtype $dtype \
        --presses $PRESSES --out $out || exit 1
    done
  done
done
