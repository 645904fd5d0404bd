#!/usr/bin/env bash
# Issue 28, round 2 of the design screen on the development split: per-layer budgets at the same total
# (prob_decode_min_variance_priority_floor20_layers) against the chosen design (prob_decode_min_variance_priority_floor20).
# 8 streams of 1024 tokens, chunk 32, interval 32, seeds 0 1 2. The rule is in docs/streaming.md
# ("Round 2: per-layer budgets"), written before this ran. Resumable: run again to finish. One budget per call: ./run.sh 256
cd "$(dirname "$0")/../../../.."
PRESSES="prob_decode_min_variance_priority_floor20 prob_decode_min_variance_priority_floor20_layers"
PYTHONPATH=$PWD .venv/bin/python -m evaluation stream --split dev --tokens 1024 --streams 8 \
    --budget "$1" --chunk 32 --interval 32 --presses $PRESSES --seeds 0 1 2 --out results/archive/stream/dev-round2
