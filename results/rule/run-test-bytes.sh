#!/usr/bin/env bash
# The bytes each press of the test pool holds on the cache (keys, values, correction bias), measured on the contexts
# of the committed test records, in float32 and bfloat16 (python -m evaluation.bench bytes). Resumable.
#   sh results/rule/run-test-bytes.sh [OUT_ROOT]   -> <OUT_ROOT>/bytes/test-records/{ruler,prose,recall}-{float32,bfloat16}.jsonl
PY="${PY:-/work/main/.venv/bin/python}"
OUT="${1:-results}"
export PYTHONPATH=$PWD
POOL="topk_kvzip_widest topk_kvzip_ragged_fit topk_kvzip_layers kvzip topk_keydiff_block8 h2o snapkv tova keydiff
  expected_attention hybrid_keydiff_block8_a90 prob_min_h_priority prob_min_h_priority_head"
RULER="results/test/ruler-1024 results/test/hybrid-1024 results/test/ruler-1024-two-regimes results/test/round2-ruler-1024
  results/test/round2-ruler-1024-cand results/test/ruler-1024-prob results/test/regime-ruler-1024
  results/test/regime-ruler-1024-cand results/test/round2-ruler-1024-pick2"
PROSE="results/prose/test-1024 results/prose/test-1024-round2-cand results/prose/test-1024-round2"
RECALL="results/recall/test-1024 results/recall/test-1024-cand results/recall/test-1024-round2
  results/recall/test-1024-round2-cand results/recall/test-1024-added"
for regime in RULER PROSE RECALL; do
  eval folders=\$$regime
  $PY -m evaluation.bench bytes --results $folders --name test-records --presses $POOL --ratios 0.5 0.75 \
    --dtypes float32 bfloat16 --out "$OUT" || exit 1
done
