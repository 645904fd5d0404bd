"""Oracle benchmark: exact eviction on small synthetic instances, against top-k and sampling with and without SNIS.

One instance: n keys and values in R^d (standard normal), an eviction query q_t = s * z (z standard
normal, s = ``query_scale``), and ``later`` queries q_j = q_t + noise * s * z_j drawn near it.
Attention at q: p(q)_i = softmax(q . k_i / sqrt(d)); the output over a kept set S with weights w
(w = 1: plain renormalisation) is o_S(q) = sum_{i in S} w_i e^{s_i} v_i / sum_{i in S} w_i e^{s_i};
the error is the Euclidean distance ||o_S(q) - o(q)|| to the full output.

Methods (k = n / 2 kept):
- opt_now: the subset of size k with the least error at q_t (brute force over all C(n, k));
- opt_later: the subset of size k with the least mean error over the later queries (brute force);
- topk: the k largest p_t = p(q_t);
- sample: Poisson counts c_i ~ Poisson(m p_t,i) with m from ``kvpress_prob.samplers.budget.solve_draws`` so
  that the expected kept count is k (``kvpress_prob.samplers.poisson.poisson_sample``), kept = c > 0, plain
  renormalisation; sample+SNIS: the same draws with weights c_i / (m p_t,i) (the paper's SNIS);
  sample+SNIS-HT (beyond the paper, ``inclusion_weights=True``): the same kept sets with weights
  1 / q_i, q_i = 1 - exp(-m p_t,i). Sampling errors are averaged over ``draws`` draws per instance
  (its kept count is k only in expectation).

Relative error = mean error of the method / mean error of the optimum for the same criterion
(opt_now at q_t, opt_later at the later queries), over the instances of one n; the per-instance
median of the ratio is reported too.

The instances are synthetic (no model), so ``evaluation.engine`` does not apply; the draws are
``kvpress_prob.samplers.poisson.poisson_sample`` with m from ``kvpress_prob.samplers.budget.solve_draws``.

Modules: ``measure`` (instances, brute force, draws), ``report`` (tables, plot), ``cli``.
"""
