#!/usr/bin/env bash
# Issue 28 streaming TEST split at budget 128 (the chosen design, its twin, snapkv; 16 test streams of 1024
# tokens, chunk 32, interval 32, seeds 0 1 2), run on the short lane in calls of at most $LIMIT seconds
# (default 450); a rerun continues where it stopped.
cd "$(dirname "$0")/../../.."
LIMIT=${LIMIT:-450}
PYTHONPATH=$PWD timeout "$LIMIT" .venv/bin/python -m evaluation stream --split test --tokens 1024 \
    --streams 16 --budget 128 --chunk 32 --interval 32 --presses snapkv prob_decode_min_variance_priority_floor20 \
    prob_decode_min_variance_priority_floor20_nocorr --seeds 0 1 2 --out results/stream/test
rc=$?; echo "$(date -u +%T) rc=$rc"
