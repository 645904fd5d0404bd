# RULER development split, round 3: KVzip's widest allocation with the paper's correction (cross_kvzip_*_widest)
# beside topk_kvzip_widest and prob_min_h, on the 8 examples of results/archive/dev/round2-ruler-1024 (same data seed,
# length, tasks and settings), at r = 0.5, 0.75 and 0.9. Resumable.
PRESSES=${PRESSES:-"topk_kvzip_widest cross_kvzip_block1_a75_widest cross_kvzip_block1_a90_widest prob_min_h"}
PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios ${RATIOS:-0.5 0.75 0.9} --seeds ${SEEDS:-0 1 2} --decode-batch 48 --presses ${PRESSES} --out results/archive/dev/round3-ruler-1024
