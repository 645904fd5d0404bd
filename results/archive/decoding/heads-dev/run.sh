#!/usr/bin/env bash
# Per-head decoding budgets on the ragged cache (prob_decode_min_variance_priority_floor20_heads) beside the
# chosen decoding design with one budget per head (prob_decode_min_variance_priority_floor20), its per-layer
# budgets (_layers) and kvpress's DecodingPress(SnapKV), on the development split: 8 streams of 1024 tokens,
# chunk 32, interval 32, seeds 0 1 2, at equal bytes (the corrected presses hold their SNIS weight in the budget).
# Resumable: run again to finish. One budget per call: ./run.sh 256
cd "$(dirname "$0")/../../../.."
PRESSES="snapkv prob_decode_min_variance_priority_floor20 prob_decode_min_variance_priority_floor20_layers prob_decode_min_variance_priority_floor20_heads"
PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python -m evaluation stream --split dev --tokens 1024 \
    --streams 8 --budget "$1" --chunk 32 --interval 32 --presses $PRESSES --seeds 0 1 2 --out results/archive/decoding/heads-dev
