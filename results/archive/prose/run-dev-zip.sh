# Issue 26: KVzip's kept set with real eviction (kvpress_prob/presses/kvzip_alloc.py) on the prose dev windows of
# results/archive/prose/dev-1024-regime (7 windows, one per essay); kvzip and topk_kvzip_layers are that folder's. Resumable.
PYTHONPATH=$PWD .venv/bin/python -m evaluation prose run --split dev --context 1024 \
  --presses topk_kvzip_ragged topk_kvzip_widest topk_kvzip_ragged_fit --ratios 0.5 0.75 --seeds 0 \
  --max-per-essay 1 --threads 1 --out results/archive/prose/dev-1024-zip
