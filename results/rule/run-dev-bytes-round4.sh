#!/usr/bin/env bash
# The rule of 2026-12-05, step 3: the bytes held on the cache (every storage a layer keeps alive: keys, values, the
# SNIS bias) by the presses it adds to the pool, in float32 and bfloat16, on the first MAX_EXAMPLES (default 2)
# contexts of each development regime's records. Resumable.
#   POOL="..." FOLDERS=ragged|added sh results/rule/run-dev-bytes-round4.sh [OUT_ROOT]
#     -> <OUT_ROOT>/bytes/dev-round4/<regime>-<dtype>.jsonl
PY="${PY:-.venv/bin/python}"
OUT="${1:-results}"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
case "${FOLDERS:-ragged}" in
ragged)
  POOL=${POOL:-"snapkv topk_kvzip_global prob_min_h_ragged cross_kvzip_block1_a75_toprest_ragged
    cross_kvzip_block1_a50_toprest_ragged topk_gate_layers topk_gate_layers_recent10 topk_gate_layers_recent25
    topk_gate_layers_recent50"}
  RULER="results/archive/dev/round3-ruler-1024 results/archive/dev/ragged-ruler-1024 results/archive/dev/ragged-presses-ruler-1024 results/archive/dev/fast-ruler-1024"
  PROSE="results/archive/prose/dev-1024-round3 results/archive/prose/dev-1024-ragged results/archive/prose/dev-1024-ragged-presses results/archive/prose/dev-1024-fast"
  RECALL="results/archive/recall/dev-1024-round3 results/archive/recall/dev-1024-ragged results/archive/recall/dev-1024-ragged-presses results/archive/recall/dev-1024-fast" ;;
added)
  POOL=${POOL:-"snapkv adakv_snapkv_ragged topk_gate_ragged"}
  RULER="results/archive/dev/round3-ruler-1024 results/archive/dev/round4-added-ruler-1024"
  PROSE="results/archive/prose/dev-1024-round3 results/archive/prose/dev-1024-round4-added"
  RECALL="results/archive/recall/dev-1024-round3 results/archive/recall/dev-1024-round4-added" ;;
esac
for regime in RULER PROSE RECALL; do
  eval folders=\$$regime
  $PY -m evaluation.bench bytes --results $folders --name dev-round4 --presses $POOL --ratios 0.5 0.75 0.9 \
    --dtypes float32 bfloat16 --max-examples ${MAX_EXAMPLES:-2} --out "$OUT" || exit 1
done
