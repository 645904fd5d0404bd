# development split (data seed 0, first example of each of 8 tasks, 1024 tokens): issue 16 items 3-4 (helper calib).
# Calibrated proposals were first screened without decoding (proposal shape: effective support and needle share,
# results/archive/bench/attention/proposals-dev-1024, command.txt there); the two KeyDiff calibrations were then decoded. Two
# earlier versions of the calibrated sweep (with prob_expected_attention_block8_priority[_ent] and the uncalibrated
# prob_keydiff_block8_priority) were stopped before their first example finished, to save CPU.
OMP_NUM_THREADS=1 kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --seeds 0 1 2 --decode-batch 48 --ratios 0.25 0.5 0.75 0.9 --presses prob_keydiff_block8_priority_rank --out results/archive/dev/calibrated-1024
OMP_NUM_THREADS=1 kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --seeds 0 1 2 --decode-batch 48 --ratios 0.25 0.5 0.75 0.9 --presses prob_keydiff_block8_priority_ent --out results/archive/dev/calibrated-ent-1024
# r = 0.9 for the presses whose r = 0.25..0.75 records are in results/archive/dev/candidates-1024 and results/archive/dev/blocks-1024
OMP_NUM_THREADS=1 kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --seeds 0 1 2 --decode-batch 48 --ratios 0.9 --presses prob_tova_block8_priority tova knorm streaming_llm keydiff lagkv expected_attention topk_tova_block8 topk_tova_block16 topk_knorm_block8 --out results/archive/dev/ratio09-1024
# (stopped after 2 examples to save CPU; continued with the presses the comparisons need:)
OMP_NUM_THREADS=1 kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --seeds 0 1 2 --decode-batch 48 --ratios 0.9 --presses prob_tova_block8_priority expected_attention topk_knorm_block8 --out results/archive/dev/ratio09-1024
# span-aware units vs fixed blocks of 8
# prob_tova_span8_priority was removed from the registry (issue 19): priority over widened span units is biased; its records stay readable
OMP_NUM_THREADS=1 kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --seeds 0 1 2 --decode-batch 48 --ratios 0.25 0.5 0.75 0.9 --presses topk_keydiff_block8 topk_keydiff_span8 topk_tova_span8 prob_tova_span8_priority --out results/archive/dev/spans-1024
# (stopped after 2 examples: the process died at a load average of 20-40)
