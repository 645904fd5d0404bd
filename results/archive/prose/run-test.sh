#!/usr/bin/env bash
# The prose TEST split at one length: run-test.sh 1024 (every test essay long enough, one window each) or
# run-test.sh 2048 4 (the first 4 windows of the split's order: fixed before any test result was read, for time).
# The presses reported whatever the rule picks (its top-k pool, the paper's pi_min-h and its uncorrected twin, the
# RULER-chosen hybrid), then $CHOSEN (docs/recommendation-rule.md). Resumable: rerun to continue.
set -u
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
FIXED="streaming_llm snapkv tova h2o knorm keydiff expected_attention prob_min_h prob_min_h_nocorr hybrid_keydiff_block8_a90"
$PY -m evaluation prose run --split test --context "$1" --presses $FIXED ${CHOSEN:-} --ratios 0.5 0.75 --seeds 0 1 2 \
    --max-per-essay 1 ${2:+--max-windows $2} --threads 1 --out "results/prose/test-$1"
