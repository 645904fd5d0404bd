#!/usr/bin/env bash
# After the rule (results/archive/rule/dev-rule.md): the chosen presses on the prose test split, 1024 then 2048, into the same
# folders as run-test.sh 1024 / run-test.sh 2048 4 (resumable; the shared prefill is redone for the added presses).
# prob_min_h_priority = RECOMMENDED = RECOMMENDED_PROSE; _nocorr its uncorrected twin; _head its equal-memory twin (a
# per-head budget: every head keeps the same count, so nothing is padded); RECOMMENDED_RETRIEVAL =
# hybrid_keydiff_block8_a90 is in the fixed list.
set -u
cd "$(dirname "$0")/../.."
export CHOSEN="prob_min_h_priority prob_min_h_priority_nocorr prob_min_h_priority_head"
results/archive/prose/run-test.sh 1024
results/archive/prose/run-test.sh 2048 4
