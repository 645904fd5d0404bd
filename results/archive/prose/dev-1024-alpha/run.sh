# prose DEVELOPMENT split (docs/protocol.md, Prose split), n = 1024, T = 256, the first window of each essay (as the
# prose dev sweep results/archive/prose/dev-1024: 7 windows of 7 essays), r = 0.5 0.75, seeds 0 1 2. Resumable. First the two
# main entropy-set hybrids and the pi_min-h one's uncorrected twin, then the others, then prob_min_h and snapkv again
# (the same presses of results/archive/prose/dev-1024 are the comparison if this folder does not have them).
set -e
for P in "prob_min_h_ent_alpha prob_min_h_ent_alpha_nocorr hybrid_keydiff_block8_ent_alpha" "prob_min_h_block8_ent_alpha hybrid_tova_block8_ent_alpha prob_min_h_block8_ent_alpha_nocorr" "prob_min_h snapkv"; do
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m evaluation prose run --split dev --context 1024 --presses $P --ratios 0.5 0.75 --seeds 0 1 2 --max-per-essay 1 --threads 1 --no-report --out results/archive/prose/dev-1024-alpha
done
