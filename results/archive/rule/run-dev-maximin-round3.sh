# Round 3 of the maximin rule on the development splits (docs/recommendation-rule.md, "Round 3"): the pool run on
# all three at r = 0.5, 0.75 and 0.9 (RULER 8 examples, prose 7 windows, recall 12 windows), the price of
# results/bench/price-round3 (RECOMMENDED_FAST: prefill <= 1.2 x snapkv's) and the bytes of run-dev-bytes-round3.sh.
#   sh results/archive/rule/run-dev-maximin-round3.sh  -> results/archive/rule/dev-maximin-round3.md (+ .csv, the frontier plots)
PY=".venv/bin/python"
export PYTHONPATH=$PWD
$PY -m evaluation.report.maximin_table dev --ratios 0.5 0.75 0.9 --fast --price results/bench/price-round3/price.jsonl results/bench/price-round3-toprest/price.jsonl \
  --ruler results/archive/dev/round3-ruler-1024 results/archive/dev/round3-toprest-ruler-1024 \
  --prose results/archive/prose/dev-1024-round3 results/archive/prose/dev-1024-round3-toprest \
  --recall results/archive/recall/dev-1024-round3 results/archive/recall/dev-1024-round3-toprest \
  --bytes results/bytes/dev-round3/ruler-float32.jsonl results/bytes/dev-round3/ruler-bfloat16.jsonl \
    results/bytes/dev-round3/prose-float32.jsonl results/bytes/dev-round3/prose-bfloat16.jsonl \
    results/bytes/dev-round3/recall-float32.jsonl results/bytes/dev-round3/recall-bfloat16.jsonl \
  --out results/archive/rule/dev-maximin-round3.md
$PY -m evaluation.report.frontier results/archive/rule/dev-maximin-round3.csv --price results/bench/price-round3/price.jsonl results/bench/price-round3-toprest/price.jsonl \
  --out results/archive/rule/dev-round3-frontier.png
