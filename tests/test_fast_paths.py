"""The fast paths of KVzip's presses against slow references: ``widest_fit`` by one sort against the binary search
over global top-k calls it replaced and a brute force over every k; pi_min-h's chunked attention mass (queries
scaled once, only each chunk's diagonal block masked) against dense float64 attention, contiguous and sampled
rows. (KVzip's folded scoring is compared with kvpress's dense scores in float64 in tests/test_kvzip_scoring.py.)"""

import math

import pytest
import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.presses.allocations import widest_fit
from kvpress_prob.proposals.attention import attention_mass


def search_fit(scores: torch.Tensor, ratio: float) -> tuple[int, torch.Tensor]:
    """The implementation ``widest_fit`` replaced: a binary search over k, each width from a global top-k call."""
    L, _, H, n = scores.shape
    budget = L * compute_n_kept(n, ratio)

    def width(k: int) -> torch.Tensor:
        top = scores.reshape(-1).topk(k).indices if k > 0 else scores.new_zeros(0, dtype=torch.long)
        return torch.bincount(top // n, minlength=L * H).view(L, H).amax(dim=1).clamp(min=1)

    lo, hi = 0, L * H * n
    if int(width(hi).sum()) <= budget:
        return hi, width(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if int(width(mid).sum()) <= budget else (lo, mid)
    return lo, width(lo)


def brute_fit(scores: torch.Tensor, ratio: float) -> tuple[int, list[int]]:
    """Every k from 0 up, in plain Python over the entries sorted by score (float64, distinct scores)."""
    L, _, H, n = scores.shape
    budget = L * max(1, int(n * (1 - ratio)))
    entries = sorted(((float(scores[l, 0, h, i]), l, h) for l in range(L) for h in range(H) for i in range(n)),
                     reverse=True)
    counts = [[0] * H for _ in range(L)]
    best = (0, [1] * L)
    for k, (_, l, h) in enumerate(entries, start=1):
        counts[l][h] += 1
        widths = [max(1, max(c)) for c in counts]
        if sum(widths) > budget:
            break
        best = (k, widths)
    return best


def _scores(L, H, n, seed, sinks=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(L, 1, H, n, generator=g, dtype=torch.float64) ** 3  # peaked, distinct
    scores[..., :sinks] = scores.amax() + 1  # pinned sinks (tied among themselves, above every other entry)
    return scores


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.75, 0.9, 0.97])
@pytest.mark.parametrize("seed", [0, 1])
def test_widest_fit_equals_a_brute_force_over_every_k(ratio, seed):
    scores = _scores(3, 2, 40, seed)
    k, widths = widest_fit(scores, ratio)
    assert (k, widths.tolist()) == brute_fit(scores, ratio)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.9])
def test_widest_fit_equals_the_binary_search_it_replaced(ratio):
    scores = _scores(6, 3, 500, seed=4, sinks=4)  # the sinks' ties are all inside any top that fits
    k, widths = widest_fit(scores, ratio)
    k_ref, widths_ref = search_fit(scores, ratio)
    assert k == k_ref and torch.equal(widths, widths_ref)


def test_the_brute_force_detects_a_wrong_width():
    scores = _scores(3, 2, 40, 0)
    k, widths = brute_fit(scores, 0.5)
    assert widths != [1, 1, 1] and (k, [1, 1, 1]) != brute_fit(scores, 0.5)


def dense_mass(queries, rows, keys, h, scaling) -> torch.Tensor:
    """sum_r h_r softmax(q_r . k * scaling over keys 0..rows[r]), explicit, in float64: (b, H_q, n)."""
    b, hq, s, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    k = keys.double().repeat_interleave(hq // hkv, dim=1)  # (b, H_q, n, d)
    out = torch.zeros(b, hq, n, dtype=torch.float64)
    for r in range(s):
        t = int(rows[r]) + 1
        logits = queries[:, :, r].double()[:, :, None, :].mul(k[:, :, :t]).sum(-1) * scaling  # (b, H_q, t)
        out[..., :t] += float(h[r]) * torch.softmax(logits, dim=-1)
    return out


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("sampled", [False, True])
def test_attention_mass_matches_dense_float64(chunk, sampled):
    g = torch.Generator().manual_seed(5)
    n, d = 50, 16
    keys = torch.randn(1, 2, n, d, generator=g)
    if sampled:  # increasing, with gaps: a chunk's rows see different key counts
        rows = torch.tensor([3, 4, 9, 17, 18, 30, 31, 32, 45, 49])
    else:
        rows = torch.arange(20, n)
    queries = torch.randn(1, 6, rows.numel(), d, generator=g) * 2
    h = torch.rand(rows.numel(), generator=g, dtype=torch.float64)
    h /= h.sum()
    scaling = 1 / math.sqrt(d) * 1.3  # not a power of two
    got = attention_mass(queries, rows, keys, h, scaling, chunk)
    want = dense_mass(queries, rows, keys, h, scaling)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)  # float32 ops against float64
    wrong = dense_mass(queries, torch.clamp(rows + 1, max=n - 1), keys, h, scaling)  # one key too many
    assert not torch.allclose(got.double(), wrong, rtol=1e-5, atol=1e-7)
