#!/usr/bin/env bash
# Issue 28 item 3: the long-generation check on test essays (the first 4 of the test split), target 128 entries
# per KV head (corrected presses at its bytes), a round every 32 tokens. Resumable (one record per essay, press, seed).
# snapkv is left out: kvpress asserts its window (31) is shorter than every forward, and the last teacher-forced
# chunk here holds 31 tokens.
cd "$(dirname "$0")/../../.."
PYTHONPATH=$PWD ${PY:-.venv/bin/python} -m experiments.decoding --split test --essays 4 --prompt 256 \
    --generate 512 --target 128 --interval 32 --window 32 --out results/archive/bench/test-split \
    --presses kvpress_tova h2o prob_decode_min_variance_priority_floor20 prob_decode_min_variance_priority_floor20_nocorr "$@"
