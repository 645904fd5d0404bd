# Round 3, development splits: KVzip's exact top with pi_min-h's top as the rest of each layer's widest width
# (cross_kvzip_block1_a<pct>_toprest_widest; deterministic, no bias), on the examples of round3-ruler-1024,
# prose/dev-1024-round3 and recall/dev-1024-round3, at r = 0.5, 0.75 and 0.9. Resumable.
#   sh results/archive/dev/run-round3-toprest.sh ruler|prose|recall
PRESSES=${PRESSES:-"cross_kvzip_block1_a50_toprest_widest cross_kvzip_block1_a75_toprest_widest"}
case "$1" in
ruler) PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses ${PRESSES} --out results/archive/dev/round3-toprest-ruler-1024 ;;
prose) PYTHONPATH=$PWD .venv/bin/python -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-round3-toprest ;;
recall) PYTHONPATH=$PWD .venv/bin/python -m evaluation recall run --split dev --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-windows 12 --no-report --out results/archive/recall/dev-1024-round3-toprest ;;
esac
