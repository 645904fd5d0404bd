# RULER development split (issue 26), second part: cross_kvzip, added after the first part started on the 8 examples of results/archive/dev/two-regimes-ruler-1024
# (same data seed, length, tasks and settings; its presses are reused, the code producing them unchanged).
PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 --seeds 0 1 2 --decode-batch 48 --presses cross_kvzip_block8_a50 cross_kvzip_block8_a75 topk_kvzip_layers cross_kvzip_block8_a50_layers --out results/archive/dev/regime-ruler-1024
