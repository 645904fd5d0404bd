# Issue 26: is kvzip's mask honest (honesty.jsonl) and how KVzip allocates across heads, with which needles and
# cued sentences surviving under each allocation (survival.jsonl). Dev splits only (experiments/zip_gap.py).
PYTHONPATH=$PWD .venv/bin/python -m experiments.zip_gap --part honesty --out results/archive/dev/zip-diagnose
PYTHONPATH=$PWD .venv/bin/python -m experiments.zip_gap --part survival --recall-windows 8 --out results/archive/dev/zip-diagnose
