#!/usr/bin/env bash
# Where the exact KVzip presses' prefill time goes, by operation (torch.profiler, self CPU time by phase and kind),
# one thread, 4096 tokens, r = 0.5: before (OUT=results/bench/kvzip-profile/before) and after the fused scoring.
#   sh results/bench/kvzip-profile/run.sh  -> $OUT/profile.md, $OUT/profile.json
PY="${PY:-.venv/bin/python}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
OUT="${OUT:-results/bench/kvzip-profile/after}"
$PY -m evaluation.bench.speed.profile_ops --length 4096 --ratio 0.5 --threads 1 \
  --presses snapkv topk_kvzip_global cross_kvzip_block1_a50_toprest_ragged --out "$OUT"
