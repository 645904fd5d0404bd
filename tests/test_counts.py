"""Kept counts are kvpress's: every whole-count design keeps ``max(1, int(n * (1 - r)))`` entries per head, or that
count times the heads of a layer or of the cache, at the ratios where float rounding moves int() (0.3, 0.8, 0.9)."""

import pytest
import torch

from kvpress_prob.presses.allocations import widest_fit
from kvpress_prob.samplers import TopKSampler
from kvpress_prob.samplers.base import whole_counts
from kvpress_prob.samplers.cross import CrossStratifiedSampler
from kvpress_prob.samplers.mixture import MixtureSampler
from tests.test_fast_paths import brute_fit


def kvpress_count(n: int, r: float) -> int:
    return max(1, int(n * (1 - r)))  # kvpress.utils.compute_n_kept, written out


RATIOS = [0.25, 0.3, 0.5, 0.75, 0.8, 0.9]


def _pi(L, H, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    pi = torch.rand(L, 1, H, n, generator=g, dtype=torch.float64) ** 4 + 1e-3
    return pi / pi.sum(-1, keepdim=True)


def test_the_ratios_move_int():
    # the case the old "+1e-6" got wrong: 1000 * 0.19999999999999996 = 199.99999999999997
    assert kvpress_count(1000, 0.8) == 199 and kvpress_count(1000, 0.9) == 99 and kvpress_count(1000, 0.3) == 700


@pytest.mark.parametrize("r", RATIOS)
@pytest.mark.parametrize("scope", ["head", "layer", "global"])
def test_topk_keeps_kvpress_count(r, scope):
    L, H, n = 3, 4, 1000
    draw = TopKSampler()(_pi(L, H, n), r, scope, torch.Generator().manual_seed(0))
    kept = draw.keep.sum(-1)  # (L, b, H)
    if scope == "head":
        assert (kept == kvpress_count(n, r)).all()
    elif scope == "layer":  # kvpress's count over the layer's H n entries (as its AdaKV counts a layer)
        assert (kept.sum(-1) == kvpress_count(H * n, r)).all()
    else:
        assert int(kept.sum()) == kvpress_count(L * H * n, r)


@pytest.mark.parametrize("r", RATIOS)
def test_pair_samplers_keep_kvpress_count(r):
    L, H, n = 2, 3, 1000
    pi = torch.stack([_pi(L, H, n, 1), _pi(L, H, n, 2)], dim=3)  # (L, b, H, 2, n)
    for sampler in (CrossStratifiedSampler(alpha=0.5, size=8), MixtureSampler(alpha=0.5, size=8)):
        draw = sampler(pi, r, "head", torch.Generator().manual_seed(0))
        assert (draw.keep.sum(-1) == kvpress_count(n, r)).all(), type(sampler).__name__


@pytest.mark.parametrize("r", RATIOS)
def test_widest_fits_kvpress_bytes(r):
    L, H, n = 4, 3, 1000
    scores = torch.rand(L, 1, H, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # distinct
    k, widths = widest_fit(scores, r)
    assert (k, widths.tolist()) == brute_fit(scores, r)  # the widths of an independent brute force, not a bound
    assert int(widths.sum()) <= L * kvpress_count(n, r)


def test_the_width_check_rejects_all_ones_widths():
    scores = torch.rand(4, 1, 3, 1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert brute_fit(scores, 0.5)[1] != [1] * 4  # all-ones widths fit the bytes, and fail the check above


def test_whole_counts_meets_the_group_total_from_a_solver_below_it():
    # a solver's allocation a little under its target (Newton from below) still gives the whole budget
    a = torch.tensor([[[2.4999999999, 1.4999999999, 0.9999999999, 5.0 - 3e-10]]]).double()  # (1, 1, 4), sum ~ 10
    counts = whole_counts(a, "layer", n=5, compression_ratio=0.5)  # int(4 x 5 x 0.5) = 10 in all
    assert int(counts.sum()) == 10 and counts.min() >= 0 and counts.tolist() == [[[3, 1, 1, 5]]]
    assert (whole_counts(a, "head", n=5, compression_ratio=0.5) == 2).all()


def test_ratio_keeping_gives_the_count_back():
    # 1 - k / n, fed to kvpress's count, loses an entry for many (n, k): ratio_keeping never does
    from kvpress_prob.samplers.base import ratio_keeping

    naive_wrong = 0
    for n in range(1, 300):
        for k in range(1, n + 1):
            r = ratio_keeping(k, n)
            assert kvpress_count(n, r) == k and abs(r - (1 - k / n)) < 1e-14, (n, k)
            naive_wrong += kvpress_count(n, 1 - k / n) != k
    assert naive_wrong > 0  # the case it exists for
