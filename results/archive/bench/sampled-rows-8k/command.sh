# issue 14: the sampled pi_min-h's prefill against SnapKV's at 8k, side by side (round-robin, 2 rounds), one torch thread,
# run by the lead from a snapshot of ca96d86 while other sweeps loaded the machine (load average 4-6)
python -m evaluation.bench speed --out results/archive/bench/sampled-rows-8k --lengths 8192 --repeats 2 --decode-steps 4 --warmup-steps 1 --memory-ratios 0.5 --presses full snapkv prob_snapkv prob_min_h prob_min_h_s256 --threads 1
