# Recall development split, round 2 (issue 26): defensive-mixture designs (kvpress_prob/samplers/mixture.py) on the same
# 12 windows as run-dev-kvzip.sh / run-dev-layers.sh. Resumable; run in chunks of at most 8 minutes:
#   PRESSES="..." RATIOS="0.75" SEEDS="0" sh results/archive/recall/run-dev-round2.sh
PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev \
    --presses ${PRESSES} --ratios ${RATIOS:-0.5 0.75} --seeds ${SEEDS:-0 1 2} --max-windows 12 --no-report \
    --out results/archive/recall/dev-1024-round2
