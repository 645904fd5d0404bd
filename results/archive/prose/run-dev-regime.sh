# Prose development split (issue 26): the new presses on the 7 windows of results/archive/prose/dev-1024 (its presses reused).
# cross_expected_attention_*, cross_keydiff_block8_a25, prob_kvzip_priority_head, hybrid_kvzip_block8_a50, topk_kvzip_head
# and cross_kvzip_block8_a50 / _a75 (per-head) were left out for compute after RULER dev (results/archive/dev/regime-ruler-1024),
# where each is far below cross_keydiff_block8_a75 or below its _layers variant. Run in chunks of 8 minutes.
PYTHONPATH=$PWD .venv/bin/python -m evaluation prose run --split dev --context 1024 --presses \
  cross_keydiff_block8_a50 cross_keydiff_block8_a75 cross_keydiff_block8_a50_nocorr cross_kvzip_block8_a50_layers \
  topk_kvzip_layers prob_min_h_priority_head prob_uniform_priority_head kvzip \
  --ratios 0.5 0.75 --seeds 0 1 2 --max-per-essay 1 --threads 1 --out results/archive/prose/dev-1024-regime
