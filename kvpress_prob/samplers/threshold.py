"""Threshold (pi-ps Poisson) sampling: the heavy entries surely, only the tail at random."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.samplers.budget import scope_target, solve_threshold, threshold_inclusion
from kvpress_prob.samplers.base import Draw, Sampler, head_target, whole_counts


@dataclass(kw_only=True)
class ThresholdSampler(Sampler):
    """Threshold sampling (the "pi-ps" design of survey sampling; Brewer and Hanif 1983): entry i is
    kept independently with probability q_i = min(1, c pi_i), c solved so that the expected kept
    count meets the budget over its scope, and a kept entry weighs 1 / q_i (Horvitz-Thompson), so
    entries with pi_i >= 1 / c are kept surely with weight 1. Among fixed-expected-size designs with
    Horvitz-Thompson weights it minimises the variance of a total proportional to pi
   .

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
        per_head = head_target(pi, compression_ratio)  # (L, b, H, 1)
        floor = None
        if self.min_keep > 0:
            floor = solve_threshold(pi, self.min_keep * per_head, "head")  # (L, b, H, 1)
        c = solve_threshold(pi, scope_target(per_head, scope), scope, floor).expand_as(per_head)
        c = c if floor is None else torch.maximum(c, floor)
        return threshold_inclusion(pi, c).nan_to_num(1.0), c  # inf * pi: keep everything

    def allocation(self, pi: torch.Tensor, compression_ratio: float, scope: str) -> torch.Tensor:
        """Each head's expected kept count (L, b, H) float64 under ``inclusion``; whole counts of it
        (``whole_counts``) for the designs that keep a whole count."""
        q, _ = self.inclusion(pi.double(), compression_ratio, scope)
        a = q.sum(-1)
        return whole_counts(a, scope, pi.shape[-1], compression_ratio).double() if self.whole_count else a

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        pi = pi.double()
        q, c = self.inclusion(pi, compression_ratio, scope)
        keep, log_weight = threshold_draw(q, generator)
        sure = float((q >= 1).double().mean())
        return Draw(keep=keep, log_weight=log_weight.float(), stats={"c": c[:, 0, :, 0].tolist(), "sure_fraction": sure})


def threshold_draw(q: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each entry independently with probability q (..., n) float64: (keep (..., n) bool,
    log-weights (..., n) float64, the Horvitz-Thompson -log q_i where kept and -inf elsewhere)."""
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64)  # [0, 1): never below q = 0
    keep = u < q
    return keep, torch.where(keep, -torch.log(q), float("-inf"))
