# test split (data seed 1, 32 examples = 4 per task, 1024 tokens); STOPPED for compute after 7 examples (niah_single_1-0..3, niah_single_2-0..2); from snapshots of commit bdd0c34 (first 20 records, with
# four more presses: topk_tova_block8 topk_knorm_block8 lagkv streaming_llm, stopped for compute), then 23f046a:
# top-k presses of results/test/ruler-1024 (run there at r = 0.1, 0.25, 0.5, 0.75) at r = 0.9, the ratio issue 16 adds
OMP_NUM_THREADS=1 python -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.9 --decode-batch 16 --presses keydiff tova knorm expected_attention topk_keydiff_block8 --out results/test/topk-r09-1024
