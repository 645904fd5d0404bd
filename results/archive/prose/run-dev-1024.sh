#!/usr/bin/env bash
# The prose development sweep at n = 1024, from this frozen worktree (results/archive/prose/dev-1024).
set -u
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
PRESSES="streaming_llm snapkv tova h2o knorm keydiff expected_attention adakv_snapkv snapkv_adaptive tova_adaptive
 prob_min_h prob_min prob_snapkv prob_tova prob_h2o prob_h2o_h prob_knorm prob_streaming_llm
 prob_min_h_nocorr prob_min_nocorr prob_snapkv_nocorr prob_tova_nocorr prob_h2o_nocorr prob_h2o_h_nocorr prob_knorm_nocorr prob_streaming_llm_nocorr
 topk_min_h prob_min_h_priority prob_min_h_threshold prob_tova_priority prob_min_h_block8 prob_min_h_strata prob_min_h_ht
 hybrid_keydiff_block8_a90 hybrid_tova_block8_a50 hybrid_tova_block8_a90 topk_keydiff_block8 prob_tova_block8_priority
 keydiff_sum4 tova_sum4"
echo "== sweep $(date -u +%T)"
$PY -m evaluation prose run --split dev --context 1024 --presses $PRESSES --ratios 0.5 0.75 --seeds 0 1 2 \
    --max-per-essay 1 --threads 1 --out results/archive/prose/dev-1024
echo "== done $(date -u +%T)"
