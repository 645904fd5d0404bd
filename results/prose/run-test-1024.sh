#!/usr/bin/env bash
# The prose TEST split at n = 1024 (one window per essay): first the presses reported whatever the rule picks
# (the rule's top-k pool, the paper's pi_min-h and its uncorrected twin, the RULER-chosen RECOMMENDED of the
# last session), then the presses the rule picks (docs/recommendation-rule.md). Resumable: rerun to continue.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
FIXED="streaming_llm snapkv tova h2o knorm keydiff expected_attention prob_min_h prob_min_h_nocorr hybrid_keydiff_block8_a90"
$PY -m evaluation prose run --split test --context 1024 --presses $FIXED ${CHOSEN:-} --ratios 0.5 0.75 --seeds 0 1 2 \
    --max-per-essay 1 --threads 1 --out results/prose/test-1024
