"""Per-head kept sets (kvpress_prob/presses/per_head.py, CrossStratifiedSampler.keep_counts) against explicit
loops in float64: the global top, kvpress AdaKV's set, the cross designs with each head's own count, and the
sampled global budget's expected count at kvpress's count."""

import math

import pytest
import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.presses.per_head import adakv_keep, global_counts, global_top, kvpress_count_ratio
from kvpress_prob.samplers import PoissonSampler
from kvpress_prob.samplers.budget import inclusion_probability, scope_target, solve_draws
from kvpress_prob.samplers.base import head_target
from kvpress_prob.samplers.cross import CrossStratifiedSampler, CrossTopSampler


def _distinct(*shape, seed=0):
    """Scores with no ties: a random permutation of 0..N-1 in float64, so every top is unique."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(math.prod(shape), generator=g).double().view(*shape)


@pytest.mark.parametrize("r", [0.0, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("n", [37, 64])
def test_global_top_is_the_largest_scores_over_every_layer_and_head(r, n):
    L, H = 3, 2
    scores = _distinct(L, 1, H, n, seed=n)
    keep = global_top(scores, r)
    total = L * H * max(1, int(n * (1 - r))) if r > 0 else L * H * n
    ranked = sorted(((scores[l, 0, h, i].item(), (l, h, i)) for l in range(L) for h in range(H) for i in range(n)),
                    reverse=True)
    expected = {where for _, where in ranked[:total]}
    got = {(l, h, i) for l, _, h, i in keep.nonzero().tolist()}
    assert got == expected and len(got) == L * H * compute_n_kept(n, r)
    counts = global_counts(scores, r)
    assert [[sum(1 for w in expected if w[:2] == (l, h)) for h in range(H)] for l in range(L)] == counts[:, 0].tolist()


def _adakv_reference(scores, r, alpha):
    """AdaKV's kept set of one layer by an explicit loop: each head's top int(alpha k) (at least 1), then the
    largest of the other scores until H k entries are kept."""
    H, n = len(scores), len(scores[0])
    k = max(1, int(n * (1 - r)))
    safe = max(1, int(k * alpha)) if alpha > 0 else 0
    kept = set()
    for h in range(H):
        order = sorted(range(n), key=lambda i: -scores[h][i])
        kept |= {(h, i) for i in order[:safe]}
    rest = sorted(((scores[h][i], (h, i)) for h in range(H) for i in range(n) if (h, i) not in kept), reverse=True)
    kept |= {where for _, where in rest[: H * k - len(kept)]}
    return kept


@pytest.mark.parametrize("r,alpha", [(0.5, 0.2), (0.75, 0.2), (0.9, 0.2), (0.9, 0.0), (0.75, 1.0), (0.5, 0.5)])
def test_adakv_keep_is_kvpress_adakv_set_by_an_explicit_loop(r, alpha):
    H, n = 4, 53
    scores = _distinct(1, H, n, seed=int(100 * r))
    scores[0, 0] *= 50  # one head far above the others: without the safeguard the others would lose everything
    keep = adakv_keep(scores, r, alpha)
    expected = _adakv_reference(scores[0].tolist(), r, alpha)
    assert {(h, i) for _, h, i in keep.nonzero().tolist()} == expected
    assert int(keep.sum()) == H * compute_n_kept(n, r)
    if alpha > 0:
        assert bool((keep.sum(-1) >= max(1, int(compute_n_kept(n, r) * alpha))).all())


def test_adakv_keep_refuses_bad_input():
    with pytest.raises(ValueError, match="alpha_safeguard"):
        adakv_keep(torch.rand(1, 2, 8), 0.5, 1.5)
    with pytest.raises(ValueError, match="compression_ratio"):
        adakv_keep(torch.rand(1, 2, 8), 1.0)
    with pytest.raises(ValueError, match=r"\(b, H, n\)"):
        adakv_keep(torch.rand(2, 8), 0.5)


def _pair(L=2, H=3, n=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    pi = torch.randperm(L * H * 2 * n, generator=g).double().view(L, 1, H, 2, n) + 1.0  # distinct: no ties
    return pi / pi.sum(-1, keepdim=True)


@pytest.mark.parametrize("alpha,size", [(0.75, 1), (0.5, 4), (0.0, 1), (1.0, 3)])
def test_cross_top_keep_counts_against_an_explicit_loop(alpha, size):
    pi = _pair()
    L, _, H, _, n = pi.shape
    counts = torch.tensor([[[5, 17, 0]], [[29, 1, 12]]])  # (L, 1, H): every head its own count, 0 and n included
    draw = CrossTopSampler(alpha=alpha, size=size).keep_counts(pi, counts, None)
    for l in range(L):
        for h in range(H):
            exact, fill = pi[l, 0, h, 0].tolist(), pi[l, 0, h, 1].tolist()
            k = int(counts[l, 0, h])
            blocks = sorted(range(0, n, size), key=lambda s: -sum(exact[s:s + size]))
            chosen = blocks[: min(int(alpha * k) // size, len(blocks))]
            top = {i for s in chosen for i in range(s, min(s + size, n))}
            rest = sorted((i for i in range(n) if i not in top), key=lambda i: -fill[i])
            expected = top | set(rest[: max(0, k - len(top))])
            got = set(draw.keep[l, 0, h].nonzero().squeeze(1).tolist())
            assert got == expected
            assert bool((draw.log_weight[l, 0, h][draw.keep[l, 0, h]] == 0).all())


@pytest.mark.parametrize("alpha,size", [(0.5, 4), (0.75, 1)])
def test_cross_keep_counts_with_one_count_is_the_sampler(alpha, size):
    """The sampler is keep_counts with kvpress's count in every head: the same draw for the same seed."""
    pi = _pair(seed=4)
    sampler = CrossStratifiedSampler(alpha=alpha, size=size)
    full = sampler(pi, 0.6, "head", torch.Generator().manual_seed(7))
    k = compute_n_kept(pi.shape[-1], 0.6)
    same = sampler.keep_counts(pi, torch.full(pi.shape[:3], k), torch.Generator().manual_seed(7))
    assert torch.equal(full.keep, same.keep) and torch.equal(full.log_weight, same.log_weight)


def test_cross_sampled_keep_counts_keep_each_count_with_unbiased_weights():
    """The sampled rest with each head's own count: exactly k_h kept, and E[w 1{kept}] = 1 outside the exact set
    (over 4000 seeds, within 5 standard errors of a weight bounded by 1 / pi_rest_min)."""
    pi = _pair(L=1, H=2, n=16, seed=2)
    counts = torch.tensor([[[3, 11]]])
    sampler = CrossStratifiedSampler(alpha=0.5, size=2)
    total, seeds = torch.zeros(1, 1, 2, 16, dtype=torch.float64), 4000
    for s in range(seeds):
        draw = sampler.keep_counts(pi, counts, torch.Generator().manual_seed(s))
        assert draw.keep.sum(-1).tolist() == [[[3, 11]]]
        total += torch.where(draw.keep, draw.log_weight.double().exp(), torch.zeros(()))
    mean = total / seeds
    exact = draw.log_weight == 0  # the exact blocks are the same for every seed (row 0 only)
    rest = pi[:, :, :, 1].masked_fill(exact, 0)
    rest = rest / rest.sum(-1, keepdim=True)
    bound = 1.0 / rest.masked_fill(exact, float("inf")).amin(-1, keepdim=True)  # the largest weight
    se = bound / math.sqrt(seeds)
    assert bool(((mean - 1).abs() <= 5 * se)[~exact].all())


def test_keep_counts_refuses_counts_out_of_range():
    with pytest.raises(ValueError, match="counts"):
        CrossTopSampler(alpha=0.5, size=1).keep_counts(_pair(), torch.full((2, 1, 3), 30), None)


@pytest.mark.parametrize("n,r", [(1047, 0.5), (1047, 0.75), (1047, 0.9), (333, 0.9)])
def test_the_global_budget_at_kvpress_count_ratio_draws_snapkv_count_in_expectation(n, r):
    """The solved m gives sum q_i = L H compute_n_kept(n, r) in float64, and the mean kept count over 200 seeds
    is within 5 standard errors of it (the count's variance is sum q_i (1 - q_i))."""
    L, H = 4, 3
    g = torch.Generator().manual_seed(n)
    pi = torch.rand(L, 1, H, n, generator=g, dtype=torch.float64) ** 4 + 1e-4  # peaked, as attention is
    pi = pi / pi.sum(-1, keepdim=True)
    ratio = kvpress_count_ratio(n, r)
    target = L * H * compute_n_kept(n, r)
    m = solve_draws(pi, scope_target(head_target(pi, ratio), "global"), "global")
    q = inclusion_probability(pi, m)
    assert float(q.sum()) == pytest.approx(target, rel=1e-9)
    counts = torch.tensor([float(PoissonSampler()(pi, ratio, "global", torch.Generator().manual_seed(s)).keep.sum())
                           for s in range(200)], dtype=torch.float64)
    se = math.sqrt(float((q * (1 - q)).sum()) / 200)
    assert abs(float(counts.mean()) - target) <= 5 * se
    assert kvpress_count_ratio(n, 0.0) == 0.0
