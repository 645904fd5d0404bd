# Round 2 of the maximin rule on the enlarged test split (docs/recommendation-rule.md, "Round 2", point 3):
# RULER 32 examples at 1024 tokens, prose 23 windows, recall 24 windows; r = 0.25 / 0.5 / 0.75. A record run in
# more than one directory keeps the last one's (the round-2 runs repeat round 1's examples).
PYTHONPATH=$PWD /work/main/.venv/bin/python results/rule/apply_maximin.py test --ratios 0.25 0.5 0.75 \
  --ruler results/test/ruler-1024 results/test/hybrid-1024 results/test/ruler-1024-two-regimes \
    results/test/regime-ruler-1024 results/test/regime-ruler-1024-cand results/test/round2-ruler-1024 \
    results/test/round2-ruler-1024-cand results/test/round2-ruler-1024-pick2 \
  --prose results/prose/test-1024 results/prose/test-1024-regime results/prose/test-1024-cand \
    results/prose/test-1024-round2 results/prose/test-1024-round2-cand \
  --recall results/recall/test-1024 results/recall/test-1024-cand results/recall/test-1024-round2 \
    results/recall/test-1024-round2-cand \
  --only topk_kvzip_widest topk_kvzip_ragged_fit cross_kvzip_block1_a75_mix50_layers topk_kvzip_layers \
    cross_kvzip_block8_a50_layers hybrid_keydiff_block8_a90 prob_min_h_priority prob_min_h_priority_head \
    prob_uniform_priority_head kvzip tova keydiff expected_attention topk_keydiff_block8 h2o snapkv \
  --out results/rule/test-maximin-round2.md "$@"
