# development split: the decomposition (survival for seven families, decoded scores for two)
set -e
OMP_NUM_THREADS=1 .venv/bin/python -m experiments.decompose --out results/archive/decompose/dev-1024 --families tova knorm snapkv streaming_llm min_h expected_attention h2o --n-examples 8 --survival-only
OMP_NUM_THREADS=1 .venv/bin/python -m experiments.decompose --out results/archive/decompose/dev-1024 --families tova knorm --n-examples 8 --decode-batch 48 --scores-only
