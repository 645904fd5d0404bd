# The maximin rule on the development splits over round 3's pool plus the fast gate presses (results/archive/dev/run-fast.sh:
# topk_gate_layers[_recent<pct>]), at r = 0.5, 0.75 and 0.9 (RULER 8 examples, prose 7 windows, recall 12 windows),
# with the price of results/bench/price-round3, price-round3-toprest and price-fast, and the bytes of round 3
# (the fast presses hold kvpress's count in every layer and head, as snapkv: their bytes are snapkv's).
#   sh results/archive/rule/run-dev-maximin-fast.sh  -> results/archive/rule/dev-maximin-fast.md (+ .csv)
PY=".venv/bin/python"
export PYTHONPATH=$PWD
$PY -m evaluation.report.maximin_table dev --ratios 0.5 0.75 0.9 --fast \
  --price results/bench/price-round3/price.jsonl results/bench/price-round3-toprest/price.jsonl results/bench/price-fast/price.jsonl \
  --ruler results/archive/dev/round3-ruler-1024 results/archive/dev/round3-toprest-ruler-1024 results/archive/dev/fast-ruler-1024 \
  --prose results/archive/prose/dev-1024-round3 results/archive/prose/dev-1024-round3-toprest results/archive/prose/dev-1024-fast \
  --recall results/archive/recall/dev-1024-round3 results/archive/recall/dev-1024-round3-toprest results/archive/recall/dev-1024-fast \
  --bytes results/bytes/dev-round3/ruler-float32.jsonl results/bytes/dev-round3/ruler-bfloat16.jsonl \
    results/bytes/dev-round3/prose-float32.jsonl results/bytes/dev-round3/prose-bfloat16.jsonl \
    results/bytes/dev-round3/recall-float32.jsonl results/bytes/dev-round3/recall-bfloat16.jsonl \
  --out results/archive/rule/dev-maximin-fast.md
