#!/usr/bin/env bash
# Issue 28: chunk 1 (true token-by-token decoding) on 4 test streams of 1024 tokens, budget 256, interval 32
# tokens, seeds 0 1 2; the chosen design, its uncorrected twin and kvpress's two best DecodingPress baselines.
# Resumable: a rerun continues where it stopped (finished units are on disk).
cd "$(dirname "$0")/../../.."
${PY:-.venv/bin/python} -m evaluation stream --split test --tokens 1024 --streams 4 --budget 256 --chunk 1 \
    --interval 32 --presses snapkv h2o prob_decode_min_variance_priority_floor20 \
    prob_decode_min_variance_priority_floor20_nocorr --seeds 0 1 2 --out results/archive/stream/test-chunk1
