# RULER development split, round 2 (issue 26): defensive-mixture designs (kvpress_prob/samplers/mixture.py) on the 8 examples
# of results/archive/dev/two-regimes-ruler-1024 (same data seed, length, tasks and settings). Resumable; chunks of <= 8 min:
#   PRESSES="..." RATIOS="0.5" SEEDS="0" sh results/archive/dev/round2-ruler-1024/command.sh
PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios ${RATIOS:-0.5 0.75} --seeds ${SEEDS:-0 1 2} --decode-batch 48 --presses ${PRESSES} --out results/archive/dev/round2-ruler-1024
