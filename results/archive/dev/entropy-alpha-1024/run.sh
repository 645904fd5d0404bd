# development split (RULER, 1024 tokens, data seed 0, the first example of each of 8 tasks): the entropy-set hybrids
# (docs/entropy-hybrid.md), then the baselines they are compared with; sampling presses over seeds 0 1 2. Resumable.
# Usage: bash results/archive/dev/entropy-alpha-1024/run.sh "0.5 0.75"
set -e
T="niah_single_1 niah_single_2 niah_single_3 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery fwe"
for P in "prob_min_h_ent_alpha prob_min_h_block8_ent_alpha hybrid_keydiff_block8_ent_alpha hybrid_tova_block8_ent_alpha" "hybrid_keydiff_block8_a90 prob_min_h snapkv topk_keydiff_block8"; do
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m evaluation run --context-length 1024 --data-seed 0 --n-examples 8 --tasks $T --ratios $1 --seeds 0 1 2 --decode-batch 48 --presses $P --out results/archive/dev/entropy-alpha-1024
done
