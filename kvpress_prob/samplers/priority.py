"""Priority sampling: a fixed number of entries per head, chosen by random priorities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.samplers.base import Draw, top_by_rank
from kvpress_prob.samplers.threshold import ThresholdSampler


@dataclass(kw_only=True)
class PrioritySampler(ThresholdSampler):
    """Priority sampling (Duffield, Lund and Thorup, "Priority sampling for estimation of arbitrary
    subset sums", J. ACM 2007): u_i ~ U(0, 1], priority pi_i / u_i; each head keeps its k_h entries
    of largest priority, and with t the (k_h + 1)-th largest priority a kept entry weighs
    max(pi_i, t) / pi_i. The weighted sum is unbiased for every subset sum, the kept count is exactly
    k_h (no padding from random sizes) and the variance is near the best of any k-entry design.

    k_h is the head's expected count under threshold sampling's allocation over the budget's scope,
    made whole by ``whole_counts``: int((1 - r) n) with ``budget="head"``, and under "layer" or
    "global" the floor of the scope's budget in all (largest remainder); see ``ThresholdSampler``.

    Parameters
    ----------
    min_keep : float, default 0.0
        Allocation floor, in [0, 1], as in ``ThresholdSampler``.
    """

    def __post_init__(self):
        super().__post_init__()
        self.whole_count = True

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        k = self.allocation(pi, compression_ratio, scope).long().clamp(max=pi.shape[-1])  # (L, b, H)
        keep, log_weight = priority_draw(pi.double(), k, generator)
        return Draw(keep=keep, log_weight=log_weight.float(), stats={"kept_per_head": k[:, 0].tolist()})


def priority_draw(pi: torch.Tensor, k: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Priority sampling of k (...,) entries per head from pi (..., n) float64 (entries with pi = 0
    are never kept while k does not exceed the positive ones): (keep (..., n) bool, log-weights
    (..., n) float64, log(max(pi_i, t) / pi_i) where kept and -inf elsewhere)."""
    n = pi.shape[-1]
    u = 1.0 - torch.rand(pi.shape, generator=generator, device=pi.device, dtype=torch.float64)  # (0, 1]
    priority = pi / u
    keep = top_by_rank(priority, k) & (pi > 0)
    ranked = priority.sort(dim=-1, descending=True).values
    t = ranked.gather(-1, k.clamp(max=n - 1)[..., None])  # (..., 1): the (k + 1)-th priority
    t = torch.where(k[..., None] >= n, torch.zeros_like(t), t)  # everything kept: weight 1
    log_weight = torch.where(keep, torch.log(torch.maximum(pi, t)) - torch.log(pi), float("-inf"))
    return keep, log_weight
