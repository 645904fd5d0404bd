# Prose development split, round 2 (issue 26): defensive-mixture designs (kvpress_prob/samplers/mixture.py) on the 7 windows
# of results/archive/prose/dev-1024 (n = 1024, T = 256). Resumable; chunks of <= 8 min:
#   PRESSES="..." RATIOS="0.5" SEEDS="0" sh results/archive/prose/run-dev-round2.sh
PYTHONPATH=$PWD .venv/bin/python -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios ${RATIOS:-0.5 0.75} --seeds ${SEEDS:-0 1 2} --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-round2
