#!/usr/bin/env bash
# Issue 28 design screen on the development split (8 streams of 1024 tokens, chunk 32, interval 32, seeds 0 1).
# Resumable: run again to finish. One budget per call: ./run.sh 256
cd "$(dirname "$0")/../../../.."
PRESSES="snapkv prob_decode_min_variance_priority prob_decode_min_variance_priority_nocorr prob_decode_min_variance_h_priority prob_decode_min_variance_priority_t2 prob_decode_min_variance_priority_cap16 prob_decode_min_variance_priority_renorm prob_decode_min_variance_priority_floor20"
PYTHONPATH=$PWD .venv/bin/python -m evaluation stream --split dev --tokens 1024 --streams 8 \
    --budget "$1" --chunk 32 --interval 32 --presses $PRESSES --seeds 0 1 --out results/archive/stream/dev-designs
