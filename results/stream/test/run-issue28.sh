#!/usr/bin/env bash
# Issue 28 streaming TEST split (docs/streaming.md, "Issue 28"): 16 test streams of 1024 tokens, chunk 32,
# interval 32, seeds 0 1 2, in passes (most needed first). One call runs the passes in order for at most
# $LIMIT seconds (default 780) and stops; a rerun continues where it stopped (finished units are on disk).
cd "$(dirname "$0")/../../.."
LIMIT=${LIMIT:-780}
END=$(( $(date +%s) + LIMIT ))
P1="snapkv prob_decode_min_variance_priority_floor20 prob_decode_min_variance_priority_floor20_nocorr"
P2="$P1 h2o prob_decode_min_variance_priority"
pass() {  # budgets... -- presses
  local left=$(( END - $(date +%s) ))
  [ "$left" -le 30 ] && { echo "$(date -u +%T) out of time before: $*"; exit 0; }
  local budgets=(); while [ "$1" != "--" ]; do budgets+=("$1"); shift; done; shift
  echo "$(date -u +%T) pass budgets ${budgets[*]} presses $* (${left}s left)"
  PYTHONPATH=$PWD timeout "$left" .venv/bin/python -m evaluation stream --split test --tokens 1024 \
      --streams 16 --budget "${budgets[@]}" --chunk 32 --interval 32 --presses "$@" --seeds 0 1 2 \
      --out results/stream/test
  local rc=$?; echo "$(date -u +%T) rc=$rc"
}
pass 256 512 -- $P1
pass 256 512 -- $P1 h2o
pass 256 512 -- $P2
# budget 128 runs on the short lane: results/stream/test/run-issue28-b128.sh
