# Diagnosis of the fast gate press (not in the maximin pool): topk_gate_widest (the global widest allocation) with
# the new default gate (results/gate/dev-prose20-ruler10-1024-...-v2.json), so that its rows against
# topk_gate_layers (results/archive/dev/run-fast.sh, same gate) separate the allocation from the gate. Resumable.
#   sh results/archive/dev/run-fast-diagnose.sh ruler|recall|prose
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
case "$1" in
ruler) $PY -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses topk_gate_widest --out results/archive/dev/fast-diagnose-ruler-1024 ;;
prose) $PY -m evaluation prose run --split dev --context 1024 --presses topk_gate_widest \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-fast-diagnose ;;
recall) $PY -m evaluation recall run --split dev --presses topk_gate_widest \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-windows 12 --no-report --out results/archive/recall/dev-1024-fast-diagnose ;;
esac
