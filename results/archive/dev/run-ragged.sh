# Development splits for the ragged cache: KVzip's global kept set evicted for real (topk_kvzip_global, each head
# its own count in a RaggedLayer) beside kvpress's masked KVzipPress (kvzip: the reference, frees nothing), on the
# examples of round3-ruler-1024, prose/dev-1024-round3 and recall/dev-1024-round3, at r = 0.5, 0.75 and 0.9.
# Resumable.   sh results/archive/dev/run-ragged.sh ruler|prose|recall   (PYTHON: the interpreter, default .venv/bin/python)
PRESSES=${PRESSES:-"topk_kvzip_global kvzip"}
PY=${PYTHON:-.venv/bin/python}
case "$1" in
ruler) PYTHONPATH=$PWD $PY -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses ${PRESSES} --out results/archive/dev/ragged-ruler-1024 ;;
prose) PYTHONPATH=$PWD $PY -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-ragged ;;
recall) PYTHONPATH=$PWD $PY -m evaluation recall run --split dev --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-windows 12 --no-report --out results/archive/recall/dev-1024-ragged ;;
esac
