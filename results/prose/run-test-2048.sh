#!/usr/bin/env bash
# The prose TEST split at n = 2048: the first 4 windows of the split's order (one per essay; fixed before any
# test result was read, for time), the same presses as run-test-1024.sh. Resumable: rerun to continue.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
FIXED="streaming_llm snapkv tova h2o knorm keydiff expected_attention prob_min_h prob_min_h_nocorr hybrid_keydiff_block8_a90"
$PY -m evaluation prose run --split test --context 2048 --presses $FIXED ${CHOSEN:-} --ratios 0.5 0.75 --seeds 0 1 2 \
    --max-per-essay 1 --max-windows 4 --threads 1 --out results/prose/test-2048
