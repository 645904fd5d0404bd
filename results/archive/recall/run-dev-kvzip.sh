# The recall development sweep, second part: KVzip's scores at equal memory and sampled (kvpress_prob/presses/kvzip.py),
# on the first 12 of the 18 windows of run-dev.sh (compute), into the same folder. Resumable.
PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev \
    --presses cross_kvzip_block8_a50 cross_kvzip_block8_a75 topk_kvzip_head prob_kvzip_priority_head hybrid_kvzip_block8_a50 \
    --ratios 0.5 0.75 --seeds 0 1 2 --max-windows 12 --out results/archive/recall/dev-1024
