# The maximin rule (docs/recommendation-rule.md) on round 2's test split with the records issue's runs, at
# r = 0.5 / 0.75, one pool for every regime: round 2's test pool, RECOMMENDED_PROSE and prob_min_h_priority.
#   sh results/archive/rule/run-test-maximin-records.sh
#     -> results/archive/rule/test-maximin-records.md: RULER 32 examples, prose 23 windows, recall 24 windows
#     -> results/archive/rule/test-maximin-records-added.md: the same, recall on the 16 added windows alone
# A record run in more than one folder keeps the last one's.
PY=".venv/bin/python"
export PYTHONPATH=$PWD
RULER="results/archive/test/ruler-1024 results/archive/test/hybrid-1024 results/archive/test/ruler-1024-two-regimes results/archive/test/round2-ruler-1024
  results/archive/test/round2-ruler-1024-cand results/archive/test/ruler-1024-prob results/archive/test/regime-ruler-1024
  results/archive/test/regime-ruler-1024-cand results/archive/test/round2-ruler-1024-pick2"
PROSE="results/prose/test-1024 results/prose/test-1024-round2-cand results/prose/test-1024-round2"
# the bytes held, measured on these records' contexts (sh results/archive/rule/run-test-bytes.sh float32, bfloat16)
BYTES=$(ls results/archive/bytes/test-records/*.jsonl)
POOL="topk_kvzip_widest topk_kvzip_ragged_fit topk_kvzip_layers kvzip topk_keydiff_block8 h2o snapkv tova keydiff
  expected_attention hybrid_keydiff_block8_a90 prob_min_h_priority prob_min_h_priority_head"
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 --ruler $RULER --prose $PROSE \
  --recall results/recall/test-1024 results/archive/recall/test-1024-cand results/recall/test-1024-round2 \
    results/recall/test-1024-round2-cand results/recall/test-1024-added \
  --only $POOL --bytes $BYTES --out results/archive/rule/test-maximin-records.md
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 --ruler $RULER --prose $PROSE \
  --recall results/recall/test-1024-round2-cand results/recall/test-1024-added \
  --only $POOL --bytes $BYTES --out results/archive/rule/test-maximin-records-added.md
