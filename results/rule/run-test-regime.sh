# Test splits of issue 26 (docs/recommendation-rule.md, step 6), after the rule was committed and applied on dev
# (results/rule/dev-maximin.md). One benchmark per call: sh results/rule/run-test-regime.sh ruler|prose|recall
# CANDIDATES: RECOMMENDED, the per-regime picks and the best of each new family (set below from dev-maximin.md).
# Counts scaled to one CPU slot, fixed before any test result was read: RULER 8 examples (data seed 1, the first of
# each of the 8 tasks), prose the first window of the first 6 test essays in the split's order, recall the first
# 10 windows in the split's order (every essay's first). Baselines' RULER and prose records at r = 0.5 / 0.75 (and
# RULER at 0.25) are reused from results/test/ruler-1024, results/test/hybrid-1024 and results/prose/test-1024.
set -u
CANDIDATES=${CANDIDATES:-}  # empty: the baselines only (launched while the dev rule was being applied)
PY="/work/main/.venv/bin/python"
export PYTHONPATH=$PWD
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
case "$1" in
ruler)
  $PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 8 --tasks $TASKS --ratios 0.25 0.5 0.75 \
    --seeds 0 1 2 --decode-batch 48 --presses $CANDIDATES prob_uniform_priority_head kvzip --out results/test/regime-ruler-1024
  $PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 8 --tasks $TASKS --ratios 0.25 \
    --seeds 0 1 2 --decode-batch 48 --presses prob_min_h_priority prob_min_h_priority_head --out results/test/regime-ruler-1024 ;;
prose)
  $PY -m evaluation prose run --split test --context 1024 --presses $CANDIDATES prob_uniform_priority_head kvzip \
    topk_keydiff_block8 --ratios 0.25 0.5 0.75 --seeds 0 1 2 --max-per-essay 1 --max-windows 6 --threads 1 \
    --out results/prose/test-1024-regime
  $PY -m evaluation prose run --split test --context 1024 --presses h2o snapkv tova keydiff expected_attention \
    prob_min_h_priority prob_min_h_priority_head hybrid_keydiff_block8_a90 --ratios 0.25 --seeds 0 1 2 \
    --max-per-essay 1 --max-windows 6 --threads 1 --out results/prose/test-1024-regime ;;
recall)
  $PY -m evaluation recall run --split test --presses $CANDIDATES prob_uniform_priority_head kvzip h2o snapkv tova \
    keydiff expected_attention topk_keydiff_block8 prob_min_h_priority prob_min_h_priority_head \
    hybrid_keydiff_block8_a90 --ratios 0.25 0.5 0.75 --seeds 0 1 2 --max-windows 10 --out results/recall/test-1024 ;;
esac
