# Prose development split (issue 26): the new presses on the 7 windows of results/prose/dev-1024 (its presses reused).
PYTHONPATH=$PWD /work/main/.venv/bin/python -m evaluation prose run --split dev --context 1024 --presses prob_min_h_priority_head prob_uniform_priority_head kvzip cross_keydiff_block8_a25 cross_keydiff_block8_a50 cross_keydiff_block8_a75 cross_keydiff_block8_a50_nocorr cross_expected_attention_block8_a25 cross_expected_attention_block8_a50 cross_expected_attention_block8_a75 \
  --ratios 0.5 0.75 --seeds 0 1 2 --max-per-essay 1 --threads 1 --out results/prose/dev-1024-regime
