#!/usr/bin/env bash
# Issue 28: 4 test streams of 4096 tokens, budgets 256 and 512, chunk 32, interval 32, seeds 0 1 2: the chosen
# design, its uncorrected twin and kvpress's two best DecodingPress baselines. Resumable.
cd "$(dirname "$0")/../../.."
PYTHONPATH=$PWD ${PY:-.venv/bin/python} -m evaluation stream --split test --tokens 4096 --streams 4 \
    --budget 256 512 --chunk 32 --interval 32 --presses snapkv h2o prob_decode_min_variance_priority_floor20 \
    prob_decode_min_variance_priority_floor20_nocorr --seeds 0 1 2 --out results/archive/stream/test-4096
