# Test splits of issue 26 (docs/recommendation-rule.md, step 6), after the rule was committed.
#   sh results/rule/run-test-regime.sh ruler|prose|recall            the baselines (launched while the dev rule ran)
#   CANDIDATES="a b" sh results/rule/run-test-regime.sh ruler-cand|prose-cand|recall-cand   the dev rule's choices
# Counts scaled to one CPU slot, fixed before any test result was read: RULER 8 examples (data seed 1, the first of
# each of the 8 tasks), prose the first window of the first 5 test essays in the split's order, recall the first
# 8 windows in the split's order (every essay's first). Baselines' RULER records at r = 0.25 / 0.5 / 0.75 and prose
# records at r = 0.5 / 0.75 are reused from results/archive/test/ruler-1024, results/archive/test/hybrid-1024, results/test/
# ruler-1024-two-regimes and results/prose/test-1024 (same examples and windows, code unchanged).
set -u
CANDIDATES=${CANDIDATES:-}
PY=".venv/bin/python"
export PYTHONPATH=$PWD
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
RULER="$PY -m evaluation run --context-length 1024 --data-seed 1 --n-examples 8 --tasks $TASKS --seeds 0 1 2 --decode-batch 48"
PROSE="$PY -m evaluation prose run --split test --context 1024 --seeds 0 1 2 --max-per-essay 1 --max-windows 5 --threads 1"
RECALL="$PY -m evaluation recall run --split test --seeds 0 1 2 --max-windows 8"
case "$1" in
ruler)
  $RULER --ratios 0.25 0.5 0.75 --presses prob_uniform_priority_head kvzip --out results/archive/test/regime-ruler-1024
  $RULER --ratios 0.25 --presses prob_min_h_priority prob_min_h_priority_head --out results/archive/test/regime-ruler-1024 ;;
prose)
  $PROSE --ratios 0.25 0.5 0.75 --presses prob_uniform_priority_head kvzip topk_keydiff_block8 \
    --out results/archive/prose/test-1024-regime
  $PROSE --ratios 0.25 --presses h2o snapkv tova keydiff expected_attention prob_min_h_priority prob_min_h_priority_head \
    hybrid_keydiff_block8_a90 --out results/archive/prose/test-1024-regime ;;
recall)
  $RECALL --ratios 0.25 0.5 0.75 --presses prob_uniform_priority_head kvzip h2o snapkv tova keydiff expected_attention \
    topk_keydiff_block8 prob_min_h_priority prob_min_h_priority_head hybrid_keydiff_block8_a90 --out results/recall/test-1024 ;;
ruler-cand) $RULER --ratios 0.25 0.5 0.75 --presses $CANDIDATES --out results/archive/test/regime-ruler-1024-cand ;;
prose-cand) $PROSE --ratios 0.25 0.5 0.75 --presses $CANDIDATES --out results/archive/prose/test-1024-cand ;;
recall-cand) $RECALL --ratios 0.25 0.5 0.75 --presses $CANDIDATES --out results/archive/recall/test-1024-cand ;;
esac
