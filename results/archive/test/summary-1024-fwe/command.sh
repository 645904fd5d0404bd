# test split, fwe only (data seed 1, fwe-0..3: the same 4 examples as the 32-example test split, checked), 1024 tokens,
# from a snapshot of commit 23f046a: the runner goes task by task, so fwe ran on its own to be reached in time
OMP_NUM_THREADS=1 python -m evaluation run --context-length 1024 --data-seed 1 --n-examples 4 --tasks fwe --ratios 0.5 0.75 --decode-batch 16 --presses keydiff_sum4 tova_sum4 knorm_sum4 --out results/archive/test/summary-1024-fwe
