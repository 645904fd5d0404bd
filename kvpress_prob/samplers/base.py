"""What every sampling design shares: the ``Draw`` it returns and the ``Sampler`` interface.

A sampler maps the proposals of every layer, pi (L, b, H, n), and the budget (the compression
ratio and its scope) to the kept mask and the log-weights of the kept entries. Every design's
weights make sum_kept w_i e^{s_i} v_i unbiased for the full
prefix sum (E[w_i 1{i kept}] = 1), so the decode-time correction is the same for all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvpress.utils import compute_n_kept

from kvpress_prob.samplers.budget import SCOPES


@dataclass
class Draw:
    """The outcome for all layers: keep (L, b, H, n) bool; log_weight (L, b, H, n) float32, -inf
    where evicted and 0 where kept surely; stats: the design's own figures (e.g. m), for ``press.stats``."""

    keep: torch.Tensor
    log_weight: torch.Tensor
    stats: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Sampler:
    """Base class of the sampling designs. A subclass implements ``__call__``.

    ``__call__(pi, compression_ratio, scope, generator) -> Draw``: pi (L, b, H, n) float64, rows
    strictly positive and summing to 1; the expected kept count is (1 - compression_ratio) * n per
    head on average over the ``scope`` ("global", "layer" or "head"); ``generator`` seeds every
    random choice, so the same seed gives the same kept set.
    """

    #: whether the kept set depends on the seed (False for deterministic designs such as top-k)
    random: bool = field(default=True, init=False, repr=False)
    #: whether each head keeps a whole count (``whole_counts``) rather than a random one with the
    #: budget as its expectation (``BlockSampler`` then rounds its block budget at random)
    whole_count: bool = field(default=False, init=False, repr=False)

    def __call__(self, pi: torch.Tensor, compression_ratio: float, scope: str, generator: torch.Generator) -> Draw:
        raise NotImplementedError


def renormalise(pi: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """pi restricted to ``allowed`` and renormalised per head (all zero where nothing is allowed)."""
    pi = pi * allowed
    total = pi.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, pi / total.clamp_min(1e-300), pi)


def exact_top(pi: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top stratum: (mask (..., n) of the ``count`` (...,) entries of largest pi (..., n),
    pi restricted to the other entries and renormalised per head)."""
    top = top_by_rank(pi, count)
    return top, renormalise(pi, ~top)


def top_by_rank(pi: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask of the ``count`` (...,) entries with the largest pi (..., n) per head. Ties are broken
    as ``torch.topk`` breaks them (as kvpress's presses do) when every head keeps the same count."""
    k = int(count.max()) if count.numel() else 0
    if count.numel() and bool((count == k).all()) and 0 < k <= pi.shape[-1]:
        return torch.zeros_like(pi, dtype=torch.bool).scatter_(-1, pi.topk(k, dim=-1).indices, True)
    order = pi.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(pi.shape[-1], device=pi.device).expand_as(order))
    return rank < count[..., None]


def check_ratio(compression_ratio: float) -> None:
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio}")


def head_target(pi: torch.Tensor, compression_ratio: float, fixed: int = 0) -> torch.Tensor:
    """Each head's expected kept count (L, b, H, 1) float64 for pi (L, b, H, n): (1 - r) n, less the
    ``fixed`` entries every head keeps surely."""
    check_ratio(compression_ratio)
    L, b, H, n = pi.shape
    return torch.full((L, b, H, 1), (1.0 - compression_ratio) * n - fixed, dtype=torch.float64, device=pi.device)


def ratio_keeping(kept: int, n: int) -> float:
    """The compression ratio 1 - kept / n whose kvpress count of ``n`` entries (``compute_n_kept``) is ``kept``
    (1 <= kept <= n): lowered by the float steps (one ulp each, at most a few) that float rounding of
    n (1 - r) would otherwise take off, so a real-valued design's target stays kept / n to 1e-15."""
    ratio = 1.0 - kept / n
    while ratio > 0 and compute_n_kept(n, ratio) < kept:
        ratio = math.nextafter(ratio, 0.0)
    return ratio


def whole_counts(allocation: torch.Tensor, scope: str, n: int, compression_ratio: float) -> torch.Tensor:
    """Whole kept counts (L, b, H) long from real per-head allocations (L, b, H) over ``n`` entries each (a
    solver's, whose group sums meet the budget up to its rounding). Each group of ``scope`` keeps kvpress's
    count of its entries, ``compute_n_kept(heads * n, compression_ratio)``, in all; each head floor(a_h) or one
    more, the extra ones to the largest fractional parts (largest remainder; ties in head order), or one less
    from the smallest where the floors already exceed the total. "head": every head keeps
    ``compute_n_kept(n, compression_ratio)``, kvpress's ``ScorerPress`` count."""
    if scope not in SCOPES:
        raise ValueError(f"budget must be one of {SCOPES}, got {scope!r}")
    a = allocation.double()
    L, b, H = a.shape
    if scope == "head":
        return torch.full((L, b, H), compute_n_kept(n, compression_ratio), dtype=torch.long, device=a.device)
    grouped = a.permute(1, 0, 2).reshape(b, L * H) if scope == "global" else a  # groups along the last dim
    total = compute_n_kept(grouped.shape[-1] * n, compression_ratio)
    whole = torch.floor(grouped)
    extra = total - whole.sum(-1, keepdim=True)  # > 0 as a solver's allocation sits a little under its target
    order = (grouped - whole).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=a.device).expand_as(order))
    # the extra ones to the largest fractional parts; a group over its total gives one back from its smallest
    whole = (whole + (rank < extra).double() - ((order.shape[-1] - 1 - rank) < -extra).double()).clamp_min(0)
    if scope == "global":
        whole = whole.view(b, L, H).permute(1, 0, 2)
    return whole.long()
