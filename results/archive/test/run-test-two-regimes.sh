#!/usr/bin/env bash
# RULER test split (data seed 1, 32 examples per the earlier test runs' tasks) for RECOMMENDED = prob_min_h_priority and
# its equal-memory per-head twin, chosen by results/archive/rule/dev-rule.md. Resumable.
set -u
cd "$(dirname "$0")/../../.."
OMP_NUM_THREADS=1 ${PY:-.venv/bin/python} -m evaluation run --context-length 1024 --data-seed 1 --n-examples 32 --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe --ratios 0.5 0.75 --seeds 0 1 2 --decode-batch 48 --presses prob_min_h_priority prob_min_h_priority_head --out results/archive/test/ruler-1024-two-regimes
