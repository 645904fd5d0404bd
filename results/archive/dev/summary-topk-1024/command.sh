# STOPPED for compute after 5 of the 8 examples
# development split (data seed 0, first example of each of 8 tasks, 1024 tokens), from a snapshot of commit 23f046a
# top-k presses with and without an evicted-set summary (deterministic: one run each)
OMP_NUM_THREADS=1 python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.25 0.5 0.75 0.9 --decode-batch 16 --presses keydiff keydiff_sum4 keydiff_sum4_tau0.5 topk_keydiff_block8 topk_keydiff_block8_sum4 --out results/archive/dev/summary-topk-1024
