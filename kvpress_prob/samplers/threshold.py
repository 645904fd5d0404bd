"""Threshold (pi-ps Poisson) sampling: the heavy entries surely, only the tail at random."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.budget import scope_target, solve_threshold, threshold_inclusion
from kvpress_prob.samplers.base import Draw, Sampler, check_ratio


@dataclass(kw_only=True)
class ThresholdSampler(Sampler):
    """Threshold sampling (the "pi-ps" design of survey sampling; Brewer and Hanif 1983): entry i is
    kept independently with probability q_i = min(1, c pi_i), c solved so that the expected kept
    count meets the budget over its scope, and a kept entry weighs 1 / q_i (Horvitz-Thompson), so
    entries with pi_i >= 1 / c are kept surely with weight 1. Among fixed-expected-size designs with
    Horvitz-Thompson weights it minimises the variance of a total proportional to pi
    (docs/method.md, "Sampling designs").

    Parameters
    ----------
    min_keep : float, default 0.0
        Allocation floor, in [0, 1]: every head keeps in expectation at least ``min_keep`` times its
        equal share (1 - r) n; the rest of the budget is spread by one c over the scope.
    """

    min_keep: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.min_keep <= 1.0:
            raise ValueError(f"min_keep must be in [0, 1], got {self.min_keep}")

    def inclusion(self, pi: torch.Tensor, compression_ratio: float, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(q (L, b, H, n), c (L, b, H, 1)): the inclusion probabilities min(1, c pi) meeting the
        budget over the scope, each head's c raised to its floor when ``min_keep`` > 0."""
        check_ratio(compression_ratio)
        L, b, H, n = pi.shape
        per_head = torch.full((L, b, H, 1), (1.0 - compression_ratio) * n, dtype=torch.float64, device=pi.device)
        floor = None
        if self.min_keep > 0:
            floor = solve_threshold(pi, self.min_keep * per_head, "head")  # (L, b, H, 1)
        c = solve_threshold(pi, scope_target(per_head, scope), scope, floor)
        c = c.expand(L, b, H, 1) if floor is None else torch.maximum(c.expand(L, b, H, 1), floor)
        return threshold_inclusion(pi, c).nan_to_num(1.0), c  # inf * pi: keep everything

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        pi = pi.double()
        q, c = self.inclusion(pi, compression_ratio, scope)
        u = torch.rand(pi.shape, generator=generator, device=pi.device, dtype=torch.float64)
        keep = u < q
        log_weight = torch.where(keep, -torch.log(q), float("-inf"))
        sure = float((q >= 1).double().mean())
        return Draw(keep=keep, log_weight=log_weight.float(), stats={"c": c[:, 0, :, 0].tolist(), "sure_fraction": sure})
