# development split (data seed 0, first example of each of 8 tasks, 1024 tokens), from a snapshot of commit 23f046a:
# RECOMMENDED at r = 0.9, the ratio the issue 16 rule adds (its other ratios are in results/archive/dev/blocks-1024)
OMP_NUM_THREADS=1 python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.9 --seeds 0 1 2 --decode-batch 16 --presses prob_tova_block8_priority --out results/archive/dev/recommended-r09-1024
