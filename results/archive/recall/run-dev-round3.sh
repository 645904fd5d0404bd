# Recall development split, round 3: KVzip's widest allocation with the paper's correction (cross_kvzip_*_widest),
# the learned gate (topk_gate_widest) and the round-3 pool's references, on the 12 windows of run-dev-round2.sh,
# at r = 0.5, 0.75 and 0.9. Resumable.
PRESSES=${PRESSES:-"snapkv h2o topk_keydiff_block8 prob_min_h topk_kvzip_widest cross_kvzip_block1_a75_widest cross_kvzip_block1_a90_widest topk_gate_widest"}
PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev \
    --presses ${PRESSES} --ratios ${RATIOS:-0.5 0.75 0.9} --seeds ${SEEDS:-0 1 2} --max-windows 12 --no-report \
    --out results/archive/recall/dev-1024-round3
