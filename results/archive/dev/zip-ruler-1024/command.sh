# Issue 26, "why kvzip's mask beats its equal-memory twin": KVzip's kept set with real eviction
# (kvpress_prob/presses/kvzip_alloc.py) on the 8 RULER dev examples of results/archive/dev/regime-ruler-1024 (same data seed,
# length, tasks and settings; kvzip, topk_kvzip_layers and topk_kvzip_head are that folder's). Resumable.
PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 --seeds 0 --decode-batch 48 --presses topk_kvzip_ragged topk_kvzip_widest topk_kvzip_ragged_fit \
  --out results/archive/dev/zip-ruler-1024
