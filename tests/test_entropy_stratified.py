"""Entropy-set stratified hybrids (kvpress_prob/samplers/entropy_stratified.py): the map, top-k at alpha = 1,
and unbiased weights whatever alpha each head gets."""

import math
from dataclasses import dataclass

import pytest
import torch

from kvpress_prob.names.registry import get_press, is_sampling
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.entropy_stratified import EntropyStratifiedSampler, entropy_alpha


def uniform_on(n: int, support: int, rest: float = 1e-30) -> torch.Tensor:
    """(n,): mass 1 / support on the first ``support`` units, ``rest`` elsewhere (positive: still units;
    its share of the entropy, below 1e-25 nats, is far under the tolerance)."""
    pi = torch.full((n,), rest, dtype=torch.float64)
    pi[:support] = (1.0 - rest * (n - support)) / support
    return pi


def alpha_of(rows: list[torch.Tensor], k: float) -> torch.Tensor:
    pi = torch.stack(rows)[None, None]  # (1, 1, heads, n)
    return entropy_alpha(pi, torch.full(pi.shape[:3], k, dtype=torch.float64))[0, 0]


def test_entropy_map_on_hand_built_distributions():
    """No unit sure: alpha = log(n / N) / log(n / k) with N = exp(H), clamped to [0, 1]; sure units (c pi >= 1
    at budget k) are exact and the map applies to the rest. Expected values by hand, n = 1024, k = 256."""
    n, k = 1024, 256
    # uniform -> 0; uniform on 512 -> no unit sure (c pi = 1/2), alpha = log 2 / log 4 = 1/2
    assert torch.allclose(alpha_of([uniform_on(n, n), uniform_on(n, 512)], k),
                          torch.tensor([0.0, 0.5], dtype=torch.float64), atol=1e-12)
    # uniform on S <= k: those S units are sure and the (uniform) rest is sampled: alpha = S / k
    assert torch.allclose(alpha_of([uniform_on(n, 128), uniform_on(n, 1), uniform_on(n, 256)], k),
                          torch.tensor([0.5, 1 / 256, 1.0], dtype=torch.float64), atol=1e-12)
    # units of zero mass are not units: uniform on 512 of 1024, 0 elsewhere, is uniform over its 512 units
    assert float(alpha_of([uniform_on(n, 512, rest=0.0)], 128)) == pytest.approx(0.0, abs=1e-12)
    # a peak of 8 units over a uniform rest, whatever its mass mu: the peak is sure, the rest sampled
    peaks = []
    for mu in (0.1, 0.5, 0.9, 0.99):
        p = torch.full((n,), (1 - mu) / (n - 8), dtype=torch.float64)
        p[:8] = mu / 8
        peaks.append(p)
    assert torch.allclose(alpha_of(peaks, k), torch.full((4,), 8 / k, dtype=torch.float64), atol=1e-12)
    # the same peak over a rest that is itself peaked (1/rank^2): its ranking matters, alpha rises towards 1
    zipf = 1.0 / torch.arange(1, n - 8 + 1, dtype=torch.float64) ** 2
    p = torch.cat([torch.full((8,), 0.5 / 8, dtype=torch.float64), 0.5 * zipf / zipf.sum()])
    got = float(alpha_of([p], k))
    # by hand: find the sure set at budget k, then the map on the renormalised rest
    lo, hi = 1.0, 1e12
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if float((mid * p).clamp(max=1).sum()) < k else (lo, mid)
    sure = hi * p >= 1
    rest = p[~sure] / p[~sure].sum()
    n_r, k_r = int((~sure).sum()), k - int(sure.sum())
    a_r = min(1.0, max(0.0, (math.log(n_r) + float((rest * rest.log()).sum())) / math.log(n_r / k_r)))
    assert got == pytest.approx((int(sure.sum()) + a_r * k_r) / k, abs=1e-9)
    assert got > 0.5
    # a head that keeps every unit gets 1, whatever its shape
    assert float(alpha_of([uniform_on(8, 8)], 8.0)) == 1.0


def heads_of_different_entropies(n: int, g: torch.Generator) -> torch.Tensor:
    """(5, n) strictly positive rows: geometric decay, three spikes over a floor, a Zipf, a mixture, near-uniform."""
    geometric = 0.5 ** torch.arange(n, dtype=torch.float64)
    geometric = 0.98 * geometric / geometric.sum() + 0.02 / n  # with a floor, as proposals have
    spike = torch.full((n,), 0.01 / n, dtype=torch.float64)
    spike[[3, 17, 29]] += 0.99 / 3
    zipf = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.5
    zipf = zipf[torch.randperm(n, generator=g)]
    mixture = torch.rand(n, generator=g, dtype=torch.float64) ** 3 + 0.02
    flat = 1.0 + 0.1 * torch.rand(n, generator=g, dtype=torch.float64)
    rows = torch.stack([geometric, spike, zipf, mixture, flat])
    return rows / rows.sum(-1, keepdim=True)


@pytest.mark.parametrize("design", ["priority", "threshold"])
def test_weights_unbiased_for_every_unit_whatever_alpha_each_head_gets(design):
    """E[w_i 1{i kept}] = 1 for every unit of every head, with alpha_h from 1 down to near 0 in one call.
    5 layers (the five heads' shapes) x 3000 replicate heads (budget per head, so replicates are i.i.d.).
    Tolerance: 5 standard errors of each unit's Monte Carlo mean; 200 units, so a false alarm has
    probability below 200 * 5.7e-7 (normal tail). The weighted sum of f is tested the same way, and the
    unweighted sum must miss it for the heads that sample."""
    g = torch.Generator().manual_seed(0)
    n, reps = 40, 3000
    shapes = heads_of_different_entropies(n, g)  # (4, n)
    pi = shapes[:, None, None, :].expand(5, 1, reps, n).contiguous()
    draw = EntropyStratifiedSampler(design=design)(pi, 0.75, "head", torch.Generator().manual_seed(1))
    alpha = torch.tensor(draw.stats["alpha"], dtype=torch.float64)  # (5, reps): per layer, per head
    assert bool((alpha == alpha[:, :1]).all())  # the same shape, the same alpha
    a = alpha[:, 0]  # by hand (entropy_alpha's docstring): 0.73, 0.3 (3 sure of 10), 0.55, 0.29, 0.0003
    assert float(a[0]) > 0.7 and float(a[4]) < 0.01 and float(a[1:4].min()) > 0.2 and float(a[1:4].max()) < 0.6, a
    w = draw.log_weight.double().exp()[:, 0]  # (4, reps, n), 0 where evicted
    mean, se = w.mean(1), w.std(1) / reps**0.5  # (4, n)
    z = (mean - 1.0).abs() / se.clamp_min(1e-12)
    assert bool(((mean == 1.0) | (z < 5)).all()), float(z.max())
    f = torch.rand(n, generator=g, dtype=torch.float64) * 10  # not proportional to pi
    estimates = (w * f).sum(-1)  # (5, reps)
    est_se = estimates.std(1) / reps**0.5
    assert bool(((estimates.mean(1) - f.sum()).abs() <= 5 * est_se + 1e-9).all())
    unweighted = (draw.keep[:, 0].double() * f).sum(-1).mean(1)  # (5,)
    sampling = a < 1
    assert bool(((unweighted - f.sum()).abs()[sampling] > 5 * est_se[sampling]).all())
    kept = draw.keep[:, 0].sum(-1).double()  # (5, reps): k = 10 per head
    if design == "priority":
        assert bool((kept == 10).all())
    else:
        assert bool(((kept.mean(1) - 10).abs() < 5 * kept.std(1).clamp_min(1e-9) / reps**0.5).all())


def unbiased_per_unit(w: torch.Tensor) -> bool:
    """E[w_i 1{i kept}] = 1 for every unit, from w (reps, n) (0 where evicted): units kept at least 30 times
    one by one (5 standard errors); the rarely kept ones (tiny pi, huge weights) as a group, whose summed
    weight estimates their count (5 standard errors). A unit never drawn fails the group."""
    reps = w.shape[0]
    often = (w > 0).sum(0) >= 30
    mean, se = w.mean(0), w.std(0) / reps**0.5
    ok = bool(((mean == 1.0) | ((mean - 1).abs() < 5 * se))[often].all())
    if bool((~often).any()):
        group = w[:, ~often].sum(-1)  # (reps,)
        ok &= abs(float(group.mean()) - int((~often).sum())) < 5 * float(group.std()) / reps**0.5
    return ok


def test_blocks_and_global_budget_stay_unbiased():
    """Under BlockSampler the units are blocks of 8 with their own alpha; with a global budget the heads share
    one threshold, so the spiked head gets a small allocation (k_h = 3) and alpha_h = 0.97 < 1, whose
    round(alpha_h k_h) = k_h would keep a top-k and never draw its rest (issue 25): it keeps k_h - 1 exactly
    and draws the rest. Every head with alpha_h < 1 has E[w 1{kept}] = 1 at every position (2000
    replicates, ``unbiased_per_unit``); a head with alpha_h = 1 is top-k with weight 1."""
    g = torch.Generator().manual_seed(2)
    n, reps = 64, 2000
    shapes = heads_of_different_entropies(n, g)
    pi = shapes[:, None, None, :].expand(5, 1, reps, n).contiguous()
    for sampler, scope in [(BlockSampler(size=8, inner=EntropyStratifiedSampler()), "head"),
                           (EntropyStratifiedSampler(), "global")]:
        draw = sampler(pi, 0.75, scope, torch.Generator().manual_seed(3))
        w = draw.log_weight.double().exp()[:, 0]  # (5, reps, n)
        alpha = torch.tensor(draw.stats["alpha"], dtype=torch.float64)[:, 0]  # (5,)
        kept = draw.keep[:, 0, 0].sum(-1)  # (5,) positions (equal to units without blocks)
        for head in range(5):
            if alpha[head] == 1:  # a fixed set: torch.topk of the head's pi, weight 1
                reference = torch.zeros(n, dtype=torch.bool).scatter_(0, shapes[head].topk(int(kept[head])).indices, True)
                assert torch.equal(draw.keep[head, 0], reference.expand(reps, n)) and bool((w[head][:, reference] == 1).all())
            else:
                assert unbiased_per_unit(w[head]), (scope, head)
        assert len(set(alpha.tolist())) == 5
    exact = torch.tensor(draw.stats["exact_per_head"])[:, 0]
    assert int(kept[1]) == 3 and 0 < 1 - float(alpha[1]) < 0.5 / 3  # alpha < 1, round(alpha k) = k: issue 25
    assert int(exact[1]) == 2  # so one fewer is kept exactly


@dataclass(kw_only=True)
class GivenAlpha(EntropyStratifiedSampler):
    """The same sampler with a given per-head alpha (L, b, H) instead of the entropy map."""

    given: torch.Tensor

    def exact_fraction(self, pi, allocation):
        return self.given.to(allocation)


def test_alpha_one_is_top_k_exactly():
    """Heads with alpha_h = 1 keep torch.topk's int((1 - r) n) entries with weight 1 for every seed, next to
    heads with alpha_h = 0.5 that sample; and the entropy map gives 1 when threshold sampling is itself
    deterministic (a head uniform on k units, 1e-30 elsewhere), whose draw is then that top-k."""
    g = torch.Generator().manual_seed(5)
    n, ratio = 200, 0.5
    k = int((1 - ratio) * n)
    pi = torch.softmax(torch.randn(1, 1, 4, n, generator=g, dtype=torch.float64) * 2, -1)
    given = torch.tensor([[[1.0, 0.5, 1.0, 0.5]]], dtype=torch.float64)
    reference = torch.zeros_like(pi, dtype=torch.bool).scatter_(-1, pi.topk(k, dim=-1).indices, True)
    sampled_differ = False
    for seed in range(3):
        draw = GivenAlpha(given=given)(pi, ratio, "head", torch.Generator().manual_seed(seed))
        top = draw.keep[..., [0, 2], :]
        assert torch.equal(top, reference[..., [0, 2], :])
        assert bool((draw.log_weight[..., [0, 2], :][top] == 0).all())
        assert bool(torch.isinf(draw.log_weight[..., [0, 2], :][~top]).all())
        sampled_differ |= not torch.equal(draw.keep[..., [1, 3], :], reference[..., [1, 3], :])
        assert bool((draw.keep.sum(-1) == k).all())
    assert sampled_differ  # the alpha = 0.5 heads did sample
    fits = uniform_on(n, k)[torch.randperm(n, generator=g)][None, None, None]
    draw = EntropyStratifiedSampler()(fits, ratio, "head", torch.Generator().manual_seed(0))
    assert draw.stats["alpha"] == 1.0 and torch.equal(draw.keep, fits > 1e-20)


def test_same_seed_same_draw_and_no_fixed_alpha():
    pi = torch.softmax(torch.randn(2, 1, 3, 64, generator=torch.Generator().manual_seed(0)), -1).double()
    a = EntropyStratifiedSampler()(pi, 0.5, "global", torch.Generator().manual_seed(4))
    b = EntropyStratifiedSampler()(pi, 0.5, "global", torch.Generator().manual_seed(4))
    assert torch.equal(a.keep, b.keep) and torch.equal(a.log_weight, b.log_weight)
    with pytest.raises(TypeError, match="alpha"):
        EntropyStratifiedSampler(alpha=0.5)
    with pytest.raises(ValueError, match="design"):
        EntropyStratifiedSampler(design="poisson")


@pytest.mark.parametrize("name", ["prob_min_h_ent_alpha", "prob_min_h_block8_ent_alpha",
                                  "hybrid_keydiff_block8_ent_alpha", "hybrid_tova_block8_ent_alpha"])
def test_registered_with_uncorrected_twins(name):
    press, twin = get_press(name, 0.5), get_press(f"{name}_nocorr", 0.5)
    sampler = press.sampler.inner if isinstance(press.sampler, BlockSampler) else press.sampler
    assert isinstance(sampler, EntropyStratifiedSampler) and is_sampling(name)
    assert press.correct and not twin.correct and twin.sampler == press.sampler


def test_alpha_diagnostic_reads_every_layer_and_head():
    """experiments.entropy_alpha.alphas: one prefill under the press gives (layers, KV heads) alphas in
    [0, 1], and they move with the budget."""
    from conftest import random_ids, tiny_model

    from experiments.entropy_alpha import alphas

    model = tiny_model("llama")
    a = alphas(model, random_ids(64, seed=1), "prob_min_h_ent_alpha", 0.5)
    assert a.shape == (3, 2) and ((a >= 0) & (a <= 1)).all()
    b = alphas(model, random_ids(64, seed=1), "prob_min_h_ent_alpha", 0.9)
    assert not (a == b).all()  # the budget enters the map
