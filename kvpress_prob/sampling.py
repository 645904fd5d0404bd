"""Drawing the kept entries and their log-weights (METHOD.md sections 2-4).

Counts are Poisson: c_i ~ Poisson(m pi_i) independently. This is the paper's m i.i.d. draws with
replacement with a Poisson(m) total instead of a fixed one (given the total, the counts are
multinomial). It takes O(n) per head however large m is, and the SNIS estimate is invariant to the
total. The weight of a kept entry is w_i = c_i / (m pi_i), with E[w_i] = 1: sum_i w_i e^{s_i} v_i
is unbiased for the full prefix sum, so new tokens enter the same softmax with weight 1.

Optional strata (beyond the paper): ``n_sink`` first and ``window`` last positions, and the top
fraction ``alpha`` of each head's allocation by pi, are kept exactly with weight 1; the rest is
sampled from pi restricted to what is left. ``coordinated=True`` replaces independent counts by one
uniform u_i per position shared by every layer and head: i is kept where u_i < q_i (the same
inclusion probability q_i = 1 - exp(-m pi_i)), with weight 1 / q_i (Horvitz-Thompson).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.budget import expected_kept, inclusion_probability, solve_draws


@dataclass
class Draw:
    """The outcome for all layers: keep (L, b, H, n) bool, log_weight (L, b, H, n) (-inf where
    evicted, 0 on exact strata), m (the draws of the sampled stratum, broadcastable to (L, b, H, 1))."""

    keep: torch.Tensor
    log_weight: torch.Tensor
    m: torch.Tensor


def _renormalise(pi: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """pi restricted to ``allowed`` and renormalised per head (all zero where nothing is allowed)."""
    pi = pi * allowed
    total = pi.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, pi / total.clamp_min(1e-300), pi)


def top_by_rank(pi: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask of the ``count`` (..., ) entries with the largest pi (..., n), per head."""
    order = pi.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(pi.shape[-1], device=pi.device).expand_as(order))
    return rank < count[..., None]


def sample(
    pi: torch.Tensor,
    m: torch.Tensor,
    generator: torch.Generator | None = None,
    coordinated: bool = False,
    inclusion_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw the sampled stratum: pi (L, b, H, n), m broadcastable to (L, b, H, 1) (inf = keep all).

    Returns (kept (L, b, H, n) bool, log-weights (L, b, H, n) float64, meaningful where kept):
    log(c_i / (m pi_i)) for independent Poisson counts (the paper), or -log q_i with
    q_i = 1 - exp(-m pi_i) for coordinated sampling and for ``inclusion_weights=True``
    (Horvitz-Thompson: 1 / q_i = E[c_i / (m pi_i) | c_i > 0], the count weight Rao-Blackwellised
    over the kept set; also unbiased, without the Poisson noise of c_i on frequently drawn entries).
    """
    pi = pi.double()
    m = torch.as_tensor(m, dtype=torch.float64, device=pi.device).expand(*pi.shape[:-1], 1)
    finite = torch.isfinite(m)
    if coordinated:
        u = torch.rand(pi.shape[1], pi.shape[-1], generator=generator, device=pi.device, dtype=torch.float64)
        q = inclusion_probability(pi, m)
        return u[None, :, None, :] < q, -torch.log(q)
    rate = torch.where(finite, m, torch.zeros_like(m)) * pi  # (L, b, H, n)
    counts = torch.poisson(rate, generator=generator)
    kept = (counts > 0) | (~finite & (pi > 0))
    if inclusion_weights:
        return kept, -torch.log(inclusion_probability(pi, m))
    return kept, torch.where(finite, torch.log(counts) - torch.log(rate), torch.zeros_like(rate))


def draw(
    pi: torch.Tensor,
    compression_ratio: float,
    scope: str = "global",
    generator: torch.Generator | None = None,
    n_sink: int = 0,
    window: int = 0,
    alpha: float = 0.0,
    coordinated: bool = False,
    inclusion_weights: bool = False,
) -> Draw:
    """Choose the kept entries of every head of every layer from its proposal.

    pi (L, b, H, n): proposals (rows sum to 1, strictly positive). The expected kept count,
    strata included, is (1 - compression_ratio) * n per head on average over the ``scope``.
    """
    L, b, H, n = pi.shape
    pi = pi.double()
    device = pi.device
    fixed = torch.zeros(n, dtype=torch.bool, device=device)
    fixed[: min(n_sink, n)] = True
    if window > 0:
        fixed[max(0, n - window) :] = True
    n_fixed = int(fixed.sum())
    budget = (1.0 - compression_ratio) * n  # expected kept entries per head
    if n_fixed > budget:
        raise ValueError(
            f"n_sink + window = {n_fixed} exceed the kept budget (1 - compression_ratio) * n = {budget:.1f}"
        )
    pi_rest = _renormalise(pi, ~fixed)
    per_head = torch.full((L, b, H, 1), budget - n_fixed, dtype=torch.float64, device=device)
    target = {"global": per_head.sum((0, 2), keepdim=True), "layer": per_head.sum(2, keepdim=True), "head": per_head}
    m = solve_draws(pi_rest, target[scope], scope)  # group shape
    exact = fixed.expand(L, b, H, n)
    if alpha > 0:
        k = expected_kept(pi_rest, m.expand(L, b, H, 1))  # (L, b, H): each head's allocation
        a = torch.round(alpha * k).long()
        top = top_by_rank(pi_rest, a)
        exact = exact | top
        pi_rest = _renormalise(pi_rest, ~top)
        target_rest = (k - a).clamp_min(0).unsqueeze(-1)
        m = torch.zeros_like(target_rest) if alpha >= 1 else solve_draws(pi_rest, target_rest, "head")
    m = m.expand(L, b, H, 1)
    sampled, log_w = sample(pi_rest, m, generator, coordinated, inclusion_weights)
    keep = exact | sampled
    log_weight = torch.where(exact, 0.0, torch.where(sampled, log_w, float("-inf")))
    return Draw(keep=keep, log_weight=log_weight.float(), m=m[..., 0].float())
