"""Stratified hybrids whose exact fraction follows each head's entropy: top-k where the proposal is
peaked, sampling with correction where it is diffuse."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress_prob.samplers.budget import solve_threshold
from kvpress_prob.proposals.calibrated import entropy
from kvpress_prob.samplers.base import renormalise
from kvpress_prob.samplers.stratified import StratifiedSampler


def entropy_alpha(pi: torch.Tensor, allocation: torch.Tensor) -> torch.Tensor:
    """The exact fraction of each head from the entropy of its proposal: (L, b, H) in [0, 1].

    pi (L, b, H, n) sums to 1 per head over its units (positions, or blocks under ``BlockSampler``);
    allocation (L, b, H) is the head's budget k_h in units. Two steps:

    1. The sure units: those that threshold (pi-ps) sampling of k_h units would keep with probability 1,
       c_h pi_i >= 1. Every design keeps them with weight 1; they are exact whatever the head's entropy.
    2. The rest R (n_R units of positive pi, budget k_R = k_h - |sure|), with its renormalised proposal
       and effective support N_R = exp(H(pi_R)) (its perplexity):

           alpha_R = clamp( log(n_R / N_R) / log(n_R / k_R), 0, 1 ),

       the log-linear map between the two ends fixed by the estimator: alpha_R = 1 (top-k) once the
       rest's effective support fits in its budget (N_R <= k_R), alpha_R = 0 (sampling alone) for a
       uniform rest (N_R = n_R), whose ranking carries nothing.

    alpha_h = (|sure| + alpha_R k_R) / k_h. A head that keeps every unit gets 1. No constant is fitted.
    """
    pi = pi.double()
    k = allocation.double()  # (L, b, H)
    c = solve_threshold(pi, k[..., None], "head")  # (L, b, H, 1); inf where every unit is kept
    sure = (c * pi >= 1) & (pi > 0)  # (L, b, H, n)
    n_sure = sure.sum(-1).double()
    rest = renormalise(pi, ~sure)  # (L, b, H, n), 0 on the sure units
    k_rest = (k - n_sure).clamp_min(0.0)
    log_units = torch.log((rest > 0).sum(-1).double().clamp_min(1.0))  # log n_R
    above = (log_units - entropy(rest)).clamp_min(0.0)  # log(n_R / N_R): how far the rest is from uniform
    span = log_units - torch.log(k_rest.clamp_min(1.0))  # log(n_R / k_R): how far its budget is from all of it
    alpha_rest = torch.where(span > 0, above / span.clamp_min(1e-300), torch.ones_like(span)).clamp(0.0, 1.0)
    alpha = (n_sure + alpha_rest * k_rest) / k.clamp_min(1e-300)
    return torch.where(k > 0, alpha, torch.ones_like(alpha)).clamp(0.0, 1.0)


@dataclass(kw_only=True)
class EntropyStratifiedSampler(StratifiedSampler):
    """Stratified hybrid with a per-head exact fraction set by the entropy of the head's proposal:
    alpha_h comes from ``entropy_alpha``, per layer and head (beyond Geh et al., "A Probabilistic Interpretation
    of KV Cache Eviction", 2026, and the heavy-hitters-plus-sample estimators of vAttention, 2025).

    Each head's allocation k_h is threshold sampling's expected count over the budget's scope
    (int((1 - r) n) with ``budget="head"``); its round(alpha_h k_h) units of largest pi are kept with
    weight 1 and the rest of k_h is drawn from the other units by ``design`` with Horvitz-Thompson
    weights, exactly as ``StratifiedSampler`` with that head's alpha (which keeps ceil(k_h) - 1 units
    exactly where round(alpha_h k_h) would reach k_h, so that the rest is still drawn). The weights are
    unbiased for every head with alpha_h < 1: the exact stratum is a deterministic function of pi, not
    of the draw. A head with alpha_h = 1 is kvpress's top-k of pi (weight 1, nothing sampled): unbiased
    only when its allocation holds every unit of positive pi (its rest fits, n_R <= k_R); when the map
    gives 1 because the rest's perplexity fits (N_R <= k_R < n_R), the units outside the top k_h are
    never kept and their share is dropped, as under top-k. ``stats["alpha"]`` holds every layer's and
    head's alpha_h (1 marks those top-k heads).

    Parameters
    ----------
    design : {"priority", "threshold"}, default "priority"
        The sampler of the rest, as in ``StratifiedSampler``.
    min_keep : float, default 0.0
        Allocation floor, as in ``ThresholdSampler``.
    """

    alpha: float = field(default=0.0, init=False, repr=False)  # unused: alpha is set per head

    def exact_fraction(self, pi: torch.Tensor, allocation: torch.Tensor) -> torch.Tensor:
        return entropy_alpha(pi, allocation)
