# The recall benchmark's development sweep (issue 26): the first two windows of each of the 9 development
# essays long enough (18 windows), r = 0.5 and 0.75, seeds 0 1 2 for the sampling presses. Resumable.
PRESSES="streaming_llm snapkv tova h2o knorm keydiff expected_attention adakv_keydiff topk_keydiff_block8 topk_min_h kvzip
 prob_min_h prob_min_h_priority prob_min_h_priority_head hybrid_keydiff_block8_a90 prob_uniform_priority_head
 cross_keydiff_block8_a25 cross_keydiff_block8_a50 cross_keydiff_block8_a75 cross_keydiff_block8_a50_nocorr
 cross_expected_attention_block8_a25 cross_expected_attention_block8_a50 cross_expected_attention_block8_a75"
PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev --presses $PRESSES \
    --ratios 0.5 0.75 --seeds 0 1 2 --max-windows 18 --out results/archive/recall/dev-1024
