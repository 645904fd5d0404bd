# The recall development sweep, third part: KVzip's allocation over layers, on the same 12 windows as run-dev-kvzip.sh.
PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev \
    --presses topk_kvzip_layers cross_kvzip_block8_a50_layers \
    --ratios 0.5 0.75 --seeds 0 1 2 --max-windows 12 --out results/archive/recall/dev-1024
