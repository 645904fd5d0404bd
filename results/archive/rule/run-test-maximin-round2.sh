# Round 2 of the maximin rule on the enlarged test split (docs/recommendation-rule.md, "Round 2", point 3), at
# r = 0.5 / 0.75 (r = 0.25 was not run on the added examples for lack of compute). A record run in more than one
# directory keeps the last one's.
#   sh results/archive/rule/run-test-maximin-round2.sh   -> results/archive/rule/test-maximin-round2.md (RULER 32 examples, prose
#      23 windows, recall 24 windows) and results/archive/rule/test-maximin-round2-r1.md (round 1's 8 / 5 / 8, its whole pool)
PY=".venv/bin/python"
export PYTHONPATH=$PWD
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 \
  --ruler results/archive/test/ruler-1024 results/archive/test/hybrid-1024 results/archive/test/ruler-1024-two-regimes \
    results/archive/test/round2-ruler-1024 results/archive/test/round2-ruler-1024-cand \
  --prose results/prose/test-1024 results/prose/test-1024-round2-cand \
  --recall results/recall/test-1024 results/archive/recall/test-1024-cand results/recall/test-1024-round2 \
    results/recall/test-1024-round2-cand \
  --only topk_kvzip_widest topk_kvzip_ragged_fit topk_kvzip_layers kvzip topk_keydiff_block8 h2o snapkv tova keydiff \
    expected_attention hybrid_keydiff_block8_a90 prob_min_h_priority_head \
  --out results/archive/rule/test-maximin-round2.md
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 \
  --ruler results/archive/test/ruler-1024 results/archive/test/hybrid-1024 results/archive/test/ruler-1024-two-regimes \
    results/archive/test/regime-ruler-1024 results/archive/test/regime-ruler-1024-cand results/archive/test/round2-ruler-1024-cand \
  --prose results/prose/test-1024 results/archive/prose/test-1024-regime results/archive/prose/test-1024-cand \
    results/prose/test-1024-round2-cand \
  --recall results/recall/test-1024 results/archive/recall/test-1024-cand results/recall/test-1024-round2-cand \
  --only topk_kvzip_widest topk_kvzip_ragged_fit topk_kvzip_layers cross_kvzip_block8_a50_layers \
    hybrid_keydiff_block8_a90 prob_min_h_priority prob_min_h_priority_head prob_uniform_priority_head kvzip tova \
    keydiff expected_attention topk_keydiff_block8 \
  --out results/archive/rule/test-maximin-round2-r1.md
