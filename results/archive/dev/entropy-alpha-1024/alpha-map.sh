# which alpha each layer / head got (development splits only): RULER dev (8 examples) and prose dev (first window of each essay)
set -e
P="prob_min_h_ent_alpha prob_min_h_block8_ent_alpha hybrid_keydiff_block8_ent_alpha hybrid_tova_block8_ent_alpha"
OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m experiments.entropy_alpha --dataset ruler --n-examples 8 --presses $P --ratios 0.5 0.75 --out results/archive/dev/entropy-alpha-1024/alpha-map
OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m experiments.entropy_alpha --dataset prose --max-per-essay 1 --presses $P --ratios 0.5 0.75 --out results/archive/prose/dev-1024-alpha/alpha-map
