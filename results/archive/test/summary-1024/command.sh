# STOPPED for compute after 25 of the 32 examples (niah_single_1/2/3, niah_multikey_2/3, niah_multivalue, niah_multiquery-0)
# test split (data seed 1, 32 examples = 4 per task, 1024 tokens), from a snapshot of commit 23f046a:
# "top-k + summary" (c = 4 k-means entries per KV head, tau = 1, counted in the budget) for three kvpress scorers.
# The variant was fixed before any result, as the default design (the development screen could not finish first);
# r = 0.5 and 0.75 only (the target ratios, r >= 0.5; 0.9 dropped for compute).
OMP_NUM_THREADS=1 python -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.5 0.75 --decode-batch 16 --presses keydiff_sum4 tova_sum4 knorm_sum4 --out results/archive/test/summary-1024
