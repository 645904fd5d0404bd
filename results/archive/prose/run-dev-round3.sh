# Prose development split, round 3: KVzip's widest allocation with the paper's correction (cross_kvzip_*_widest)
# beside topk_kvzip_widest, prob_min_h and h2o, on the 7 windows of results/archive/prose/dev-1024 (n = 1024, T = 256),
# at r = 0.5, 0.75 and 0.9. Resumable.
PRESSES=${PRESSES:-"topk_kvzip_widest cross_kvzip_block1_a75_widest cross_kvzip_block1_a90_widest prob_min_h h2o"}
PYTHONPATH=$PWD .venv/bin/python -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios ${RATIOS:-0.5 0.75 0.9} --seeds ${SEEDS:-0 1 2} --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-round3
