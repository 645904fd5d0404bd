#!/usr/bin/env bash
# Round 3: the bytes held on the cache (keys, values, correction bias) by the round-3 pool's presses whose bytes are
# not kvpress top-k's by construction, in float32 and bfloat16, measured on the first MAX_EXAMPLES (default 2)
# contexts of each development regime's records (CPU bf16 takes minutes a context). Resumable.
#   sh results/rule/run-dev-bytes-round3.sh [OUT_ROOT]  -> <OUT_ROOT>/bytes/dev-round3/<regime>-<dtype>.jsonl
PY="${PY:-.venv/bin/python}"
OUT="${1:-results}"
export PYTHONPATH=$PWD
POOL="snapkv topk_kvzip_widest topk_gate_widest topk_keydiff_block8 cross_kvzip_block1_a75_widest
  cross_kvzip_block1_a90_widest cross_kvzip_block1_a50_toprest_widest cross_kvzip_block1_a75_toprest_widest"
RULER="results/archive/dev/round3-ruler-1024 results/archive/dev/round3-toprest-ruler-1024"
PROSE="results/archive/prose/dev-1024-round3 results/archive/prose/dev-1024-round3-toprest"
RECALL="results/archive/recall/dev-1024-round3 results/archive/recall/dev-1024-round3-toprest"
for regime in RULER PROSE RECALL; do
  eval folders=\$$regime
  $PY -m evaluation.bench bytes --results $folders --name dev-round3 --presses $POOL --ratios 0.5 0.75 0.9 \
    --dtypes float32 bfloat16 --max-examples ${MAX_EXAMPLES:-2} --out "$OUT" || exit 1
done
