# development split: the sweeps that chose the designs (resumable: rerun to continue)
set -e
# The candidates sweep began with six more presses (adakv_tova, snapkv, prob_tova_priority_s4, prob_tova_priority_s4_head,
# prob_tova_threshold_floor, prob_min_h_threshold): they ran on the first 2 examples and were dropped; then the whole
# candidates sweep was stopped after 6 of its 8 examples; the blocks sweep first also had prob_tova_block16 and
# prob_min_h_block8 (first example only). kvprob compare reports every press on the examples it ran.
OMP_NUM_THREADS=1 .venv/bin/kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.1 0.25 0.5 0.75 --seeds 0 1 2 --decode-batch 48 --presses tova knorm streaming_llm keydiff lagkv expected_attention prob_tova_threshold prob_tova_priority prob_tova_threshold_s4 prob_knorm_threshold --out results/archive/dev/candidates-1024
OMP_NUM_THREADS=1 .venv/bin/kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.1 0.25 0.5 0.75 --seeds 0 1 2 --decode-batch 48 --presses prob_tova_block8 prob_tova_block8_priority prob_knorm_block8 topk_tova_block8 topk_tova_block16 topk_knorm_block8 --out results/archive/dev/blocks-1024
# not run: the KeyDiff / ExpectedAttention proposals under the threshold and block designs were stopped to free the CPU for the test split
# OMP_NUM_THREADS=1 .venv/bin/kvprob run --context-length 1024 --data-seed 0 --n-examples 8 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.1 0.25 0.5 0.75 --seeds 0 1 2 --decode-batch 48 --presses prob_keydiff_threshold prob_keydiff_block8 topk_keydiff_block8 prob_expected_attention_block8 --out results/archive/dev/keydiff-ea-1024
