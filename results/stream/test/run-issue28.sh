#!/usr/bin/env bash
# Issue 28 streaming TEST split (docs/streaming.md, "Issue 28"): 16 test streams of 1024 tokens, chunk 32,
# interval 32, seeds 0 1 2. Resumable in chunks: each call runs at most $LIMIT seconds (default 840) and a
# rerun continues where it stopped. Usage: run-issue28.sh BUDGET... [-- EXTRA PRESSES]
cd "$(dirname "$0")/../../.."
LIMIT=${LIMIT:-840}
BUDGETS=(); EXTRA=()
while [ $# -gt 0 ]; do [ "$1" = "--" ] && { shift; EXTRA=("$@"); break; }; BUDGETS+=("$1"); shift; done
PRESSES="snapkv h2o prob_decode_min_variance_priority_floor20 prob_decode_min_variance_priority_floor20_nocorr prob_decode_min_variance_priority ${EXTRA[*]}"
echo "$(date -u +%FT%T) budgets ${BUDGETS[*]} presses $PRESSES (limit ${LIMIT}s)"
PYTHONPATH=$PWD timeout "$LIMIT" /work/main/.venv/bin/python -m evaluation stream --split test --tokens 1024 \
    --streams 16 --budget "${BUDGETS[@]}" --chunk 32 --interval 32 --presses $PRESSES --seeds 0 1 2 \
    --out results/stream/test
echo "$(date -u +%FT%T) rc=$?"
