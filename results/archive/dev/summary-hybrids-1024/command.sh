# COMPLETE for the three presses of the command (8 examples); 4 more presses on the first example only (see below)
# development split (data seed 0, first example of each of 8 tasks, 1024 tokens), from snapshots of commit bdd0c34, then 23f046a
# (an engine fix for ExpectedAttention proposals). The first command first ran with --decode-batch 48 and four more presses
# (hybrid_keydiff_block8_a50, hybrid_keydiff_block8_a75_global, hybrid_tova_block8_a75, hybrid_expected_attention_block8_a75)
# and was stopped on the first example for compute (the machine ran out of memory and CPU); their records on that
# example are kept in results.jsonl.
# sampled candidates of issue 16 (stratified hybrids)
OMP_NUM_THREADS=1 python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.25 0.5 0.75 0.9 --seeds 0 1 2 --decode-batch 16 --presses hybrid_keydiff_block8_a75 hybrid_keydiff_block8_a90 hybrid_keydiff_block8_a75_sum4 --out results/archive/dev/summary-hybrids-1024
