"""Cross-proposal hybrids and uniform random eviction (kvpress_prob/samplers/cross.py): the draw against a slow
float64 reference, exact counts, unbiased weights, equal memory on the cache, the engine's replay against
a real prefill, the grid's names, and clear errors."""

import math

import pytest
import torch
from kvpress import KVzipPress

from evaluation.engine import Prefill, cache_summary, press_prefill
from evaluation.engine import bias_bytes
from kvpress_prob.samplers.cross import CrossStratifiedSampler, CrossTopSampler
from kvpress_prob.proposals.pairs import PairProposal, UniformProposal
from kvpress_prob.names.grid import parse_name, press_name
from kvpress_prob.names.registry import get_press, is_sampling
from tests.conftest import random_ids, tiny_model


def _pi(n=29, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    pi = torch.rand(1, 1, heads, 2, n, generator=g, dtype=torch.float64) + 0.05
    return pi / pi.sum(-1, keepdim=True)


def _reference(pi, r, alpha, size, uniforms):
    """Slow float64 reference of one head: the exact blocks, then priority sampling from row 1 on the rest."""
    exact, sample = pi[0].tolist(), pi[1].tolist()
    n = len(exact)
    k = max(1, int(n * (1 - r)))  # kvpress compute_n_kept
    blocks = [(sum(exact[j] for j in range(b, min(b + size, n))), b) for b in range(0, n, size)]
    chosen = sorted(blocks, key=lambda x: -x[0])[: min(int(alpha * k) // size, len(blocks))]
    top = {j for _, b in chosen for j in range(b, min(b + size, n))}
    rest = [0.0 if j in top else sample[j] for j in range(n)]
    total = sum(rest)
    rest = [x / total for x in rest]
    m = k - len(top)
    priority = [rest[j] / uniforms[j] for j in range(n)]
    ranked = sorted(range(n), key=lambda j: -priority[j])
    kept = set(ranked[:m])
    t = priority[ranked[m]] if m < n else 0.0
    weights = {j: 0.0 for j in top} | {j: math.log(max(rest[j], t)) - math.log(rest[j]) for j in kept}
    return top | kept, weights


@pytest.mark.parametrize("r,alpha,size", [(0.5, 0.5, 4), (0.75, 0.25, 3), (0.3, 1.0, 4), (0.5, 0.0, 8)])
def test_the_draw_against_a_slow_float64_reference(r, alpha, size):
    pi = _pi()
    draw = CrossStratifiedSampler(alpha=alpha, size=size)(pi, r, "head", torch.Generator().manual_seed(3))
    u = 1.0 - torch.rand(pi[..., 1, :].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for h in range(pi.shape[2]):
        kept, weights = _reference(pi[0, 0, h], r, alpha, size, u[0, 0, h].tolist())
        got = draw.keep[0, 0, h].nonzero().squeeze(1).tolist()
        assert set(got) == kept and len(got) == max(1, int(pi.shape[-1] * (1 - r)))
        for j in kept:
            assert draw.log_weight[0, 0, h, j].item() == pytest.approx(weights[j], abs=1e-6)
        assert torch.isinf(draw.log_weight[0, 0, h][~draw.keep[0, 0, h]]).all()


@pytest.mark.parametrize("r,alpha,size", [(0.5, 0.5, 4), (0.9, 0.75, 1), (0.3, 1.0, 4), (0.5, 0.0, 8)])
def test_the_top_rest_against_a_slow_float64_reference(r, alpha, size):
    """CrossTopSampler: the same exact blocks, then the largest of row 1 outside them, all with log-weight 0."""
    pi = _pi(seed=4)
    draw = CrossTopSampler(alpha=alpha, size=size)(pi, r, "head", torch.Generator().manual_seed(3))
    for h in range(pi.shape[2]):
        exact, sample = pi[0, 0, h, 0].tolist(), pi[0, 0, h, 1].tolist()
        n, k = len(exact), max(1, int(len(exact) * (1 - r)))
        blocks = sorted(((sum(exact[b:b + size]), b) for b in range(0, n, size)), key=lambda x: -x[0])
        top = {j for _, b in blocks[: int(alpha * k) // size] for j in range(b, min(b + size, n))}
        rest = sorted((j for j in range(n) if j not in top), key=lambda j: -sample[j])[: k - len(top)]
        got = set(draw.keep[0, 0, h].nonzero().squeeze(1).tolist())
        assert got == top | set(rest) and len(got) == k
        assert (draw.log_weight[0, 0, h][draw.keep[0, 0, h]] == 0).all()
    assert not CrossTopSampler().random  # the same kept set whatever the seed


def test_weights_are_unbiased_for_every_position():
    pi, sampler = _pi(n=20, heads=1, seed=1), CrossStratifiedSampler(alpha=0.5, size=4)
    total, draws = torch.zeros(20, dtype=torch.float64), 4000
    g = torch.Generator().manual_seed(0)
    for _ in range(draws):
        d = sampler(pi, 0.5, "head", g)
        total += torch.where(d.keep[0, 0, 0], d.log_weight[0, 0, 0].double().exp(), 0.0)
    assert (total / draws - 1).abs().max() < 0.08  # E[w_i 1{i kept}] = 1; 4000 draws: a few % of noise


def test_refusals_name_the_parameter():
    with pytest.raises(ValueError, match="alpha"):
        CrossStratifiedSampler(alpha=1.5)
    with pytest.raises(ValueError, match="size"):
        CrossStratifiedSampler(size=0)
    with pytest.raises(ValueError, match="budget='head'"):
        CrossStratifiedSampler()(_pi(), 0.5, "layer", torch.Generator())
    with pytest.raises(ValueError, match="PairProposal"):
        CrossStratifiedSampler()(_pi()[..., 0, :], 0.5, "head", torch.Generator())
    with pytest.raises(TypeError, match="exact"):
        PairProposal(exact="keydiff")
    for bad in ("cross_min_h_block8_a50", "cross_keydiff_a50", "cross_keydiff_block8", "kvzip_sum4",
                "cross_keydiff_block8_a50_head", "adakv_kvzip"):
        with pytest.raises(ValueError, match="press name"):
            parse_name(bad)


def test_names_round_trip_and_build():
    for name in ("cross_keydiff_block8_a50", "cross_expected_attention_block8_a75", "cross_keydiff_block8_a50_nocorr",
                 "prob_uniform_priority_head", "kvzip"):
        assert press_name(parse_name(name)) == name
    press = get_press("cross_keydiff_block8_a25", 0.5)
    assert press.budget == "head" and press.sampler.alpha == 0.25 and press.sampler.size == 8 and press.correct
    assert not get_press("cross_keydiff_block8_a50_nocorr", 0.5).correct
    assert isinstance(get_press("kvzip", 0.5), KVzipPress) and not is_sampling("kvzip")
    assert is_sampling("cross_keydiff_block8_a50") and is_sampling("prob_uniform_priority_head")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_equal_memory_on_the_cache_and_the_replay_equals_a_real_prefill(arch):
    model, n = tiny_model(arch), 96
    ids = random_ids(n)
    names = ["cross_keydiff_block8_a50", "cross_expected_attention_block8_a25", "prob_uniform_priority_head", "keydiff"]
    shared = Prefill(model, ids, [get_press(name, 0.5, **({"seed": 1} if is_sampling(name) else {})) for name in names])
    topk = shared.compress(get_press("keydiff", 0.5))
    topk_bytes = cache_summary(topk, None, n)[1]
    for name in names[:3]:
        press = get_press(name, 0.5, seed=1)
        cache = shared.compress(press)
        held = cache_summary(cache, press, n)[1]
        assert held == topk_bytes  # exactly kvpress's count in every head: no padding
        extra = bias_bytes(cache, shared.layers)
        assert 0 < extra <= held / (2 * 16)  # one bias value per entry beside a 16-dim key and value
        real = press_prefill(model, ids, get_press(name, 0.5, seed=1))
        for a, b in zip(cache.layers, real.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_uniform_eviction_keeps_k_per_head_with_equal_weights():
    pi = torch.full((2, 1, 3, 40), 1 / 40, dtype=torch.float64)
    press = get_press("prob_uniform_priority_head", 0.75, seed=0)
    draw = press.sampler(pi[:1], 0.75, "head", torch.Generator().manual_seed(0))
    assert (draw.keep.sum(-1) == 10).all()
    for h in range(3):  # one weight per head: the correction's softmax over a head's entries ignores it
        w = draw.log_weight[0, 0, h][draw.keep[0, 0, h]]
        assert torch.equal(w, w[:1].expand_as(w))
    assert isinstance(press.proposal, UniformProposal)
