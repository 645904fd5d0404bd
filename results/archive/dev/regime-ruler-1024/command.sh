# RULER development split (issue 26): the new presses on the 8 examples of results/archive/dev/two-regimes-ruler-1024
# (same data seed, length, tasks and settings; its presses are reused, the code producing them unchanged).
PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 --seeds 0 1 2 --decode-batch 48 --presses topk_kvzip_head prob_kvzip_priority_head hybrid_kvzip_block8_a50 prob_min_h_priority_head prob_uniform_priority_head kvzip cross_keydiff_block8_a25 cross_keydiff_block8_a50 cross_keydiff_block8_a75 cross_keydiff_block8_a50_nocorr cross_expected_attention_block8_a25 cross_expected_attention_block8_a50 cross_expected_attention_block8_a75 --out results/archive/dev/regime-ruler-1024
