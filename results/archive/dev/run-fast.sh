# The fast gate press on the development splits: Fast KVzip's gates (the model's default gate, trained by
# `kvprob train-gate --set-default`, results/gate/) evicting each layer in its own hook, with the most recent 0, 10,
# 25 or 50 % of each head's count as the fill (topk_gate_layers[_recent<pct>]), on the examples of round3-ruler-1024,
# prose/dev-1024-round3 and recall/dev-1024-round3, at r = 0.5, 0.75 and 0.9. Resumable.
#   sh results/archive/dev/run-fast.sh ruler|prose|recall
PY=${PY:-.venv/bin/python}
PRESSES=${PRESSES:-"topk_gate_layers topk_gate_layers_recent10 topk_gate_layers_recent25 topk_gate_layers_recent50"}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
case "$1" in
ruler) $PY -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 \
  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe \
  --ratios 0.5 0.75 0.9 --seeds 0 --decode-batch 48 --presses ${PRESSES} --out results/archive/dev/fast-ruler-1024 ;;
prose) $PY -m evaluation prose run --split dev --context 1024 --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-fast ;;
recall) $PY -m evaluation recall run --split dev --presses ${PRESSES} \
  --ratios 0.5 0.75 0.9 --seeds 0 --max-windows 12 --no-report --out results/archive/recall/dev-1024-fast ;;
esac
