# Issue 26: KVzip's kept set with real eviction (kvpress_prob/presses/kvzip_alloc.py) on the first 12 recall dev windows
# (those of the KVzip family in results/archive/recall/dev-1024, which holds kvzip and topk_kvzip_layers). Resumable.
PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev \
  --presses topk_kvzip_ragged topk_kvzip_widest topk_kvzip_ragged_fit --ratios 0.5 0.75 --seeds 0 \
  --max-windows 12 --out results/archive/recall/dev-1024-zip
