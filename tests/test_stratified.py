"""Stratified hybrids (kvpress_prob/samplers/stratified.py): exact top stratum, HT-weighted rest."""

import pytest
import torch

from kvpress_prob.samplers.stratified import StratifiedSampler


@pytest.mark.parametrize("design", ["priority", "threshold"])
def test_weighted_sum_is_unbiased_and_dropping_weights_is_not(design):
    """E[sum_kept w_i f_i] = sum_i f_i. 4000 replicates run as 4000 heads of one call (budget per head);
    the tolerance is 5 standard errors of the Monte Carlo mean."""
    g = torch.Generator().manual_seed(0)
    n, reps = 40, 4000
    pi = torch.rand(n, generator=g, dtype=torch.float64) ** 3 + 0.01
    pi = (pi / pi.sum()).expand(1, 1, reps, n)
    f = torch.rand(n, generator=g, dtype=torch.float64) * 10  # not proportional to pi
    sampler = StratifiedSampler(alpha=0.5, design=design)
    draw = sampler(pi, 0.75, "head", torch.Generator().manual_seed(1))
    w = draw.log_weight.double().exp()  # 0 where evicted
    estimates = (w * f).sum(-1).flatten()  # (reps,)
    total = float(f.sum())
    se = float(estimates.std()) / reps ** 0.5
    assert abs(float(estimates.mean()) - total) < 5 * se
    unweighted = (draw.keep.double() * f).sum(-1).flatten()
    assert abs(float(unweighted.mean()) - total) > 5 * se
    # the top alpha of the allocation (10 units per head) is kept in every replicate with weight 1
    top = pi[0, 0, 0].topk(5).indices
    assert bool(draw.keep[..., top].all()) and bool((draw.log_weight[..., top] == 0).all())
    kept = draw.keep.sum(-1).double()
    if design == "priority":
        assert bool((kept == 10).all())
    else:
        assert abs(float(kept.mean()) - 10) < 5 * float(kept.std()) / reps ** 0.5


def test_same_seed_same_draw_and_bad_input():
    pi = torch.softmax(torch.randn(2, 1, 3, 50, generator=torch.Generator().manual_seed(0)), -1).double()
    a = StratifiedSampler(alpha=0.75)(pi, 0.5, "global", torch.Generator().manual_seed(4))
    b = StratifiedSampler(alpha=0.75)(pi, 0.5, "global", torch.Generator().manual_seed(4))
    assert torch.equal(a.keep, b.keep) and torch.equal(a.log_weight, b.log_weight)
    assert abs(float(a.keep.sum(-1).double().mean()) - 25) < 1  # the global allocation, whole units
    with pytest.raises(ValueError, match="alpha"):
        StratifiedSampler(alpha=1.0)
    with pytest.raises(ValueError, match="design"):
        StratifiedSampler(design="poisson")



@pytest.mark.parametrize("design", ["priority", "threshold"])
def test_a_small_allocation_still_samples_its_rest(design):
    """alpha = 0.9 at k_h = 4: round(0.9 * 4) = 4 = k_h would keep the top 4 exactly and never draw the other
    4 units (issue 25); 3 are kept exactly and the rest is drawn, so E[w_i 1{i kept}] = 1 for every unit
    (4000 replicate heads, 5 standard errors)."""
    g = torch.Generator().manual_seed(3)
    n, reps = 8, 4000
    pi = torch.rand(n, generator=g, dtype=torch.float64) + 0.2
    pi = (pi / pi.sum()).expand(1, 1, reps, n)
    draw = StratifiedSampler(alpha=0.9, design=design)(pi, 0.5, "head", torch.Generator().manual_seed(1))
    assert draw.stats["exact_per_head"] == [[3] * reps]
    w = draw.log_weight.double().exp()[0, 0]  # (reps, n), 0 where evicted
    mean, se = w.mean(0), w.std(0) / reps ** 0.5
    assert bool(((mean == 1.0) | ((mean - 1).abs() < 5 * se)).all()), mean
    assert bool((w > 0).any(0).all())  # every unit is drawn
