# The maximin rule on the test splits, over the presses step 6 of docs/recommendation-rule.md runs on test.
# h2o and snapkv are left out: results/archive/test/ruler-1024 holds them on one of the 8 examples only (niah_single_1-0).
PYTHONPATH=$PWD .venv/bin/python -m evaluation.report.maximin_table test --ratios 0.25 0.5 0.75 \
  --ruler results/archive/test/ruler-1024 results/archive/test/hybrid-1024 results/archive/test/ruler-1024-two-regimes \
    results/archive/test/regime-ruler-1024 results/archive/test/regime-ruler-1024-cand \
  --prose results/prose/test-1024 results/archive/prose/test-1024-regime results/archive/prose/test-1024-cand \
  --recall results/recall/test-1024 results/archive/recall/test-1024-cand \
  --only topk_kvzip_layers cross_kvzip_block8_a50_layers hybrid_keydiff_block8_a90 prob_min_h_priority \
    prob_min_h_priority_head prob_uniform_priority_head kvzip tova keydiff expected_attention topk_keydiff_block8
