# development split (data seed 0, the 7 NIAH examples of the 8, 1024 tokens), from the worktree at commit 4cedd18
OMP_NUM_THREADS=1 python -m experiments.needle_attention --presses keydiff keydiff_sum4 tova tova_sum4 --ratios 0.5 --out results/archive/dev/needle-attention
