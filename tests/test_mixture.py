"""Defensive mixture proposals (kvpress_prob/samplers/mixture.py): the mixture and the draw against a slow float64
reference, unbiased weights by a fixed-seed Monte Carlo check whose tolerance comes from the central
limit theorem (and which a wrong weight fails), per-head allocation, equal memory on the cache, names, errors."""

import math

import pytest
import torch

from evaluation.engine import cache_summary, press_prefill
from evaluation.engine import bias_bytes
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.names.grid import parse_name, press_name
from kvpress_prob.samplers.mixture import MixtureSampler, defensive_mixture, peak_share, rank_calibrated
from kvpress_prob.names.registry import get_press
from tests.conftest import random_ids, tiny_model


def _pi(n=29, heads=3, seed=0, layers=1):
    g = torch.Generator().manual_seed(seed)
    pi = torch.rand(layers, 1, heads, 2, n, generator=g, dtype=torch.float64) + 0.05
    return pi / pi.sum(-1, keepdim=True)


def _blocks(x, size):
    return [sum(x[j] for j in range(b, min(b + size, len(x)))) for b in range(0, len(x), size)]


def _mixture_ref(p, s, allowed, lam):
    """Slow float64 (1 - lam) p|allowed + lam (1/rank of s among the allowed)|allowed, as lists."""
    idx = [j for j in range(len(p)) if allowed[j]]
    order = sorted(idx, key=lambda j: (-s[j], j))
    rank = {j: r + 1 for r, j in enumerate(order)}
    zp, zr = sum(p[j] for j in idx), sum(1 / rank[j] for j in idx)
    return [((1 - lam) * p[j] / zp + lam / rank[j] / zr) if allowed[j] else 0.0 for j in range(len(p))]


def _reference(pi, r, alpha, size, lam, unit, uniforms, peaked=None):
    """One head, slow: exact blocks of row 0, the tail priority-sampled from the mixture over units."""
    ret, eff = pi[0].tolist(), pi[1].tolist()
    n = len(ret)
    k = max(1, int(n * (1 - r)))  # kvpress compute_n_kept
    n_blocks = int(alpha * k) // size
    if peaked is not None and sum(sorted(ret, reverse=True)[:k]) / sum(ret) >= peaked:
        n_blocks = k // size
    blocks = sorted(range(len(_blocks(ret, size))), key=lambda b: (-_blocks(ret, size)[b], b))[:n_blocks]
    top = {j for b in blocks for j in range(b * size, min(b * size + size, n))}
    if unit == 1:
        units = [[j] for j in range(n)]
    else:
        units = [list(range(b, min(b + size, n))) for b in range(0, n, size)]
    r_u = [sum(ret[j] for j in u) for u in units]
    e_u = [sum(eff[j] for j in u) for u in units]
    allowed = [not (set(u) & top) for u in units]
    q = _mixture_ref(e_u, r_u, allowed, lam)
    m = (k - len(top)) // unit
    priority = [q[j] / uniforms[j] for j in range(len(units))]
    ranked = sorted(range(len(units)), key=lambda j: -priority[j])
    chosen = ranked[:m]
    t = priority[ranked[m]] if m < len(units) else 0.0
    weights = {j: 0.0 for j in top}
    for u in chosen:
        for j in units[u]:
            weights[j] = math.log(max(q[u], t)) - math.log(q[u])
    return weights


def test_the_mixture_against_a_slow_float64_reference_and_its_defensive_bounds():
    g = torch.Generator().manual_seed(1)
    p, s = torch.rand(2, 3, 17, generator=g, dtype=torch.float64), torch.rand(2, 3, 17, generator=g, dtype=torch.float64)
    allowed = torch.rand(2, 3, 17, generator=g) > 0.3
    for lam in (0.0, 0.3, 0.7, 1.0):
        q = defensive_mixture(p, s, allowed, lam)
        rho = rank_calibrated(s, allowed)
        for a in range(2):
            for h in range(3):
                ref = _mixture_ref(p[a, h].tolist(), s[a, h].tolist(), allowed[a, h].tolist(), lam)
                assert q[a, h].tolist() == pytest.approx(ref, abs=1e-12)
        assert torch.allclose(q.sum(-1), torch.ones(2, 3, dtype=torch.float64))
        p_restricted = p * allowed / (p * allowed).sum(-1, keepdim=True)
        assert (q >= (1 - lam) * p_restricted - 1e-15).all() and (q >= lam * rho - 1e-15).all()  # defensive


@pytest.mark.parametrize("r,alpha,size,lam,unit", [(0.5, 0.5, 4, 0.5, 1), (0.75, 0.0, 4, 0.3, 1),
                                                   (0.5, 0.25, 4, 0.7, 4), (0.3, 0.0, 3, 1.0, 3),
                                                   (0.5, 1.0, 4, 0.5, 1)])
def test_the_draw_against_a_slow_float64_reference(r, alpha, size, lam, unit):
    pi = _pi(n=32 if unit > 1 else 29)
    sampler = MixtureSampler(alpha=alpha, size=size, lam=lam, unit=unit)
    draw = sampler(pi, r, "head", torch.Generator().manual_seed(3))
    units = pi.shape[-1] if unit == 1 else -(-pi.shape[-1] // size)
    u = 1.0 - torch.rand((1, 1, pi.shape[2], units), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    k = max(1, int(pi.shape[-1] * (1 - r)))
    for h in range(pi.shape[2]):
        weights = _reference(pi[0, 0, h], r, alpha, size, lam, unit, u[0, 0, h].tolist())
        got = draw.keep[0, 0, h].nonzero().squeeze(1).tolist()
        assert set(got) == set(weights) and len(got) <= k
        if unit == 1:
            assert len(got) == k  # exactly kvpress's count
        for j in weights:
            assert draw.log_weight[0, 0, h, j].item() == pytest.approx(weights[j], abs=1e-6)
        assert torch.isinf(draw.log_weight[0, 0, h][~draw.keep[0, 0, h]]).all()


def _monte_carlo(sampler, pi, draws, reweight=None):
    """Per position, the mean and standard error of X_i = w_i 1{i kept} over ``draws`` fixed-seed draws."""
    g = torch.Generator().manual_seed(0)
    xs = torch.zeros(draws, pi.shape[-1], dtype=torch.float64)
    for d in range(draws):
        out = sampler(pi, 0.5, "head", g)
        w = out.log_weight[0, 0, 0].double().exp()
        if reweight is not None:
            w = reweight(w, out.keep[0, 0, 0])
        xs[d] = torch.where(out.keep[0, 0, 0], w, 0.0)
    return xs.mean(0), xs.std(0) / math.sqrt(draws)


@pytest.mark.parametrize("alpha,lam,unit", [(0.0, 0.5, 1), (0.5, 0.3, 1), (0.25, 0.7, 4)])
def test_weights_are_unbiased_for_every_position(alpha, lam, unit):
    """E[w_i 1{i kept}] = 1 for every position. With N draws, the mean of X_i is 1 +- se_i, se_i the
    standard error (central limit theorem); 4.5 se_i bounds it with probability 1 - 7e-6 per position, so
    the 20 positions fail together with probability < 2e-4; the seed is fixed, so the outcome is too."""
    pi, sampler = _pi(n=20, heads=1, seed=1), MixtureSampler(alpha=alpha, size=4, lam=lam, unit=unit)
    mean, se = _monte_carlo(sampler, pi, 3000)
    assert ((mean - 1).abs() <= 4.5 * se + 1e-12).all(), (mean, se)
    exact = mean.eq(1) & se.eq(0)  # positions of the exact set in every draw: weight 1, no noise
    assert (se[~exact] > 0).all()


def test_the_unbiasedness_check_fails_wrong_weights():
    """Weights 1 / q for every kept unit (ignoring the threshold) are biased: the same check must fail."""
    pi, sampler = _pi(n=20, heads=1, seed=1), MixtureSampler(alpha=0.0, size=4, lam=0.5)
    mean, se = _monte_carlo(sampler, pi, 3000, reweight=lambda w, keep: torch.where(w > 1, w * 1.5, w))
    assert ((mean - 1).abs() > 4.5 * se).any()


def test_peaked_heads_keep_top_k_and_the_statistic_is_the_top_k_share():
    pi = _pi(n=32, heads=2, seed=2)
    pi[0, 0, 0, 0] = torch.tensor([50.0] * 8 + [1.0] * 24, dtype=torch.float64) / 424  # head 0: peaked row 0
    share = peak_share(pi[..., 0, :], 8)
    assert share[0, 0, 0].item() == pytest.approx(400 / 424)
    assert share[0, 0, 1].item() == pytest.approx(pi[0, 0, 1, 0].topk(8).values.sum().item())
    draw = MixtureSampler(alpha=0.0, size=4, lam=0.5, peaked=0.9)(pi, 0.75, "head", torch.Generator().manual_seed(0))
    assert draw.keep[0, 0, 0].nonzero().squeeze(1).tolist() == list(range(8))
    assert (draw.log_weight[0, 0, 0][:8] == 0).all()  # top-k: weight 1
    assert draw.stats["exact_blocks"][0] == [2, 0] and draw.keep[0, 0, 1].sum() == 8
    weights = _reference(pi[0, 0, 0], 0.75, 0.0, 4, 0.5, 1, [0.5] * 32, peaked=0.9)
    assert set(weights) == set(range(8))


def test_refusals_name_the_parameter():
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"lam must be a number in \[0, 1\]"):
            MixtureSampler(lam=bad)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        MixtureSampler(alpha=2.0)
    with pytest.raises(ValueError, match="unit must be 1"):
        MixtureSampler(size=8, unit=4)
    for bad in (0.0, 1.2):
        with pytest.raises(ValueError, match=r"peaked must be None or in \(0, 1\]"):
            MixtureSampler(peaked=bad)
    with pytest.raises(ValueError, match="budget='head'"):
        MixtureSampler()(_pi(), 0.5, "layer", torch.Generator())
    with pytest.raises(ValueError, match="PairProposal"):
        MixtureSampler()(_pi()[..., 0, :], 0.5, "head", torch.Generator())
    for bad in ("cross_kvzip_block8_a50_tblock_layers", "cross_kvzip_block8_a50_peak80", "cross_kvzip_block8_a50_mix150",
                "cross_keydiff_block8_a50_peak0_mix50", "prob_min_h_mix50", "cross_keydiff_block8_a50_mix50_peak0"):
        with pytest.raises(ValueError, match="press name"):
            parse_name(bad)


def test_names_round_trip_and_build():
    for name in ("cross_kvzip_block8_a0_mix50_layers", "cross_kvzip_block8_a50_mix30_tblock_layers",
                 "cross_keydiff_block8_a0_mix70", "cross_kvzip_block8_a50_mix50_peak60_layers"):
        assert press_name(parse_name(name)) == name
    s = get_press("cross_kvzip_block8_a50_mix30_tblock_layers", 0.5).sampler
    assert isinstance(s, MixtureSampler) and (s.alpha, s.lam, s.size, s.unit, s.peaked) == (0.5, 0.3, 8, 8, None)
    assert get_press("cross_kvzip_block8_a50_mix50_peak60_layers", 0.5).layers
    assert get_press("cross_keydiff_block8_a0_mix70", 0.5).sampler.peaked is None
    assert type(get_press("cross_keydiff_block8_a50", 0.5).sampler).__name__ == "CrossStratifiedSampler"


def test_equal_memory_on_the_cache():
    """Held bytes (keys + values) are at most kvpress top-k's (snapkv's), plus one bias value per kept entry."""
    model, n = tiny_model("llama"), 96
    ids = random_ids(n, seed=7)
    kvzip_scoring.clear_scores()
    names = ["cross_keydiff_block8_a0_mix50", "cross_keydiff_block8_a50_mix50_tblock", "cross_kvzip_block8_a50_mix50_layers",
             "cross_kvzip_block8_a0_mix50_peak60_layers"]
    layers = model.model.layers
    for ratio in (0.5, 0.75):
        topk_bytes = cache_summary(press_prefill(model, ids, get_press("snapkv", ratio)), None, n)[1]
        for name in names:
            press = get_press(name, ratio, seed=1)
            cache = press_prefill(model, ids, press)
            held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
            assert held <= topk_bytes, name
            assert 0 < bias_bytes(cache, layers) <= held / (2 * 16), name  # one value beside a 16-dim key and value
