"""Stratified hybrids: each head's top units kept exactly, the rest sampled with HT weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.samplers.budget import solve_threshold, threshold_inclusion
from kvpress_prob.samplers.base import Draw, exact_top
from kvpress_prob.samplers.poisson import summarise_scale
from kvpress_prob.samplers.priority import priority_draw
from kvpress_prob.samplers.threshold import ThresholdSampler, threshold_draw

DESIGNS = ("priority", "threshold")


@dataclass(kw_only=True)
class StratifiedSampler(ThresholdSampler):
    """Exact top stratum plus a sampled rest (beyond the paper; the heavy-hitters-plus-sample
    estimators of vAttention, 2025, and of stratified survey sampling).

    Each head's allocation k_h is threshold sampling's expected count over the budget's scope (as
    ``ThresholdSampler``; int((1 - r) n) with ``budget="head"``), made whole by ``whole_counts``
    for "priority". Its round(alpha k_h) units of largest pi are kept with weight 1; the remaining
    k_h - round(alpha k_h) are drawn from the other units by ``design`` on pi restricted to them, with
    Horvitz-Thompson weights: "priority" keeps exactly that many (weights max(pi, t) / pi),
    "threshold" keeps them in expectation (1 / q_i). So sum_kept w_i f_i is unbiased for sum_i f_i
    (E[w_i 1{i kept}] = 1 for every unit of positive pi). Where round(alpha k_h) would reach k_h (a small
    allocation: alpha = 0.9, k_h <= 5) and units of positive pi lie outside it, ceil(k_h) - 1 units are
    kept exactly instead, so the rest is still drawn and the weights stay unbiased.

    Parameters
    ----------
    alpha : float, default 0.75
        Fraction of each head's allocation kept exactly, in [0, 1). 0 is the design alone.
    design : {"priority", "threshold"}, default "priority"
        The sampler of the rest.
    min_keep : float, default 0.0
        Allocation floor, as in ``ThresholdSampler``.
    """

    alpha: float = 0.75
    design: str = "priority"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1) (a full top-k is TopKSampler), got {self.alpha}")
        if self.design not in DESIGNS:
            raise ValueError(f"design must be one of {DESIGNS}, got {self.design!r}")
        self.whole_count = self.design == "priority"

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        n = pi.shape[-1]
        pi = pi.double()
        allocation = self.allocation(pi, compression_ratio, scope)  # (L, b, H): kept units per head
        alpha = self.exact_fraction(pi, allocation)  # (L, b, H), in [0, 1]
        exact = torch.round(alpha * allocation).long()  # (L, b, H)
        # alpha_h < 1 promises a sampled rest: where round(alpha_h k_h) reaches k_h while units of positive pi
        # lie outside the allocation, one fewer is kept exactly (else they are never drawn: a biased top-k)
        # (1e-6 absorbs the threshold solver's rounding of a real allocation)
        whole = torch.ceil(allocation - 1e-6)
        rounded_up = (alpha < 1) & (whole >= 1) & (exact >= whole) & ((pi > 0).sum(-1) > whole)
        exact = torch.where(rounded_up, whole.long() - 1, exact)
        top, rest = exact_top(pi, exact)  # rest (L, b, H, n): 0 on the exact stratum
        target = (allocation - exact).clamp_min(0)  # (L, b, H)
        if self.design == "priority":
            sampled, log_w = priority_draw(rest, target.long().clamp(max=n), generator)
        else:
            c = solve_threshold(rest, target[..., None], "head")
            sampled, log_w = threshold_draw(threshold_inclusion(rest, c).nan_to_num(1.0), generator)
            sampled = sampled & (rest > 0)
        keep = top | sampled
        log_weight = torch.where(top, 0.0, torch.where(sampled, log_w, float("-inf")))
        return Draw(keep=keep, log_weight=log_weight.float(),
                    stats={"exact_per_head": exact[:, 0].tolist(), "alpha": summarise_scale(alpha)})

    def exact_fraction(self, pi: torch.Tensor, allocation: torch.Tensor) -> torch.Tensor:
        """The fraction (L, b, H) of each head's allocation kept exactly: ``alpha`` for every head. A
        subclass may set it per head from pi (L, b, H, n) and the allocation (L, b, H); 1 is top-k."""
        return torch.full_like(allocation, self.alpha)
