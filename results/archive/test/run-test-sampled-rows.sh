# test split (data seed 1): pi_min-h from 256 sampled query rows against the exact pi_min-h (no earlier
# test-split records of prob_min_h existed, so both run); examples in rounds of 2 per task
# (the examples are seeded per task and index, so each round adds to the last)
# Run state at the end of the session: this loop's first round was killed by the out-of-memory killer after
# 5 examples (niah_single_1 x2, niah_single_2 x2, niah_single_3 x1); the second sweep below completed.
set -e
for n in 16 24 32; do
OMP_NUM_THREADS=1 .venv/bin/kvprob run --context-length 1024 --data-seed 1 --n-examples $n --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.25 0.5 0.75 0.9 --seeds 0 1 2 --decode-batch 48 --presses prob_min_h prob_min_h_s256 --out results/archive/test/ruler-1024-sampled-rows
done
# second sweep, started alongside the first when the machine's load (20-30 on 2 cores) made it clear that the
# first would not reach the last tasks in the session: the tasks where prob_min_h scores above 0 at r >= 0.25 in
# results/paper-ruler-1024-66 (data seed 0), 4 examples each, into its own folder
OMP_NUM_THREADS=1 .venv/bin/kvprob run --context-length 1024 --data-seed 1 --n-examples 12 --tasks fwe niah_multikey_2 niah_multivalue --ratios 0.25 0.5 0.75 0.9 --seeds 0 1 2 --decode-batch 48 --presses prob_min_h prob_min_h_s256 --out results/archive/test/ruler-1024-sampled-rows-b
