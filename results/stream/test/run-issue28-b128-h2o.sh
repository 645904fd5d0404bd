#!/usr/bin/env bash
# Issue 28 streaming TEST split at budget 128: the h2o baseline (short lane, at most $LIMIT seconds, resumable).
cd "$(dirname "$0")/../../.."
LIMIT=${LIMIT:-450}
PYTHONPATH=$PWD timeout "$LIMIT" .venv/bin/python -m evaluation stream --split test --tokens 1024 \
    --streams 16 --budget 128 --chunk 32 --interval 32 --presses h2o --seeds 0 1 2 --out results/stream/test
rc=$?; echo "$(date -u +%T) rc=$rc"
