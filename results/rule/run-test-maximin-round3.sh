# Round 3 of the maximin rule on the test splits (docs/recommendation-rule.md, "Round 3"), r = 0.5, 0.75 and 0.9:
# RULER 32 examples (data seed 1), prose 23 windows, recall 24 windows, run by results/rule/run-test-round3.sh
# after the dev picks were written. prob_min_h's prose records at r = 0.5 / 0.75 are round 1's (the same 23
# windows and seeds); a record run in more than one folder keeps the last one's.
#   sh results/rule/run-test-maximin-round3.sh  -> results/rule/test-maximin-round3.md (+ .csv, the frontier plots)
PY=".venv/bin/python"
export PYTHONPATH=$PWD
$PY -m evaluation.report.maximin_table test --ratios 0.5 0.75 0.9 --fast --price results/bench/price-round3/price.jsonl results/bench/price-round3-toprest/price.jsonl \
  --ruler results/test/round3-ruler-1024 results/test/round3-ruler-1024-cand results/test/round3-ruler-1024-cand-s \
  --prose results/prose/test-1024 results/prose/test-1024-round2 results/prose/test-1024-round2-cand \
    results/prose/test-1024-round3 results/prose/test-1024-round3-cand \
  --recall results/recall/test-1024 results/recall/test-1024-added results/recall/test-1024-round2 \
    results/recall/test-1024-round2-cand results/recall/test-1024-round3 results/recall/test-1024-round3-cand \
  --only snapkv h2o topk_keydiff_block8 prob_min_h topk_kvzip_widest topk_gate_widest cross_kvzip_block1_a75_widest \
    cross_kvzip_block1_a50_toprest_widest cross_kvzip_block1_a75_toprest_widest \
  ${BYTES:+--bytes $BYTES} --out results/rule/test-maximin-round3.md
$PY -m evaluation.report.frontier results/rule/test-maximin-round3.csv --price results/bench/price-round3/price.jsonl results/bench/price-round3-toprest/price.jsonl \
  --out results/archive/rule/test-round3-frontier.png
