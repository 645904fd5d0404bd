#!/usr/bin/env bash
# The bytes held on the cache (keys, values, correction bias) by the test pool's presses whose bytes are not
# kvpress top-k's by construction, measured on the contexts of the committed test records (python -m evaluation.bench
# bytes). Resumable. float32: snapkv and the six; bfloat16: snapkv and RECOMMENDED (the dtype users run), on the
# first MAX_EXAMPLES (default 4) examples of each regime, since bf16 on this CPU takes about 2 minutes a context.
#   sh results/archive/rule/run-test-bytes.sh float32|bfloat16 [OUT_ROOT]  -> <OUT_ROOT>/bytes/test-records/<regime>-<dtype>.jsonl
PY="${PY:-.venv/bin/python}"
DTYPE="$1"
OUT="${2:-results}"
export PYTHONPATH=$PWD
case "$DTYPE" in
  float32) POOL="snapkv topk_kvzip_widest topk_kvzip_ragged_fit topk_kvzip_layers hybrid_keydiff_block8_a90
             prob_min_h_priority prob_min_h_priority_head" ;;
  bfloat16) POOL="snapkv topk_kvzip_widest"; LIMIT="--max-examples ${MAX_EXAMPLES:-4}" ;;  # CPU bf16: ~2 min a context
  *) echo "usage: sh results/archive/rule/run-test-bytes.sh float32|bfloat16 [OUT_ROOT]"; exit 2 ;;
esac
RULER="results/archive/test/ruler-1024 results/archive/test/hybrid-1024 results/archive/test/ruler-1024-two-regimes results/archive/test/round2-ruler-1024
  results/archive/test/round2-ruler-1024-cand results/archive/test/ruler-1024-prob results/archive/test/regime-ruler-1024
  results/archive/test/regime-ruler-1024-cand results/archive/test/round2-ruler-1024-pick2"
PROSE="results/prose/test-1024 results/prose/test-1024-round2-cand results/prose/test-1024-round2"
RECALL="results/recall/test-1024 results/archive/recall/test-1024-cand results/recall/test-1024-round2
  results/recall/test-1024-round2-cand results/recall/test-1024-added"
for regime in RULER PROSE RECALL; do
  eval folders=\$$regime
  $PY -m evaluation.bench bytes --results $folders --name test-records --presses $POOL --ratios 0.5 0.75 \
    --dtypes "$DTYPE" --out "$OUT" $LIMIT || exit 1
done
