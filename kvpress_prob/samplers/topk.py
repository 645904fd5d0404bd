"""Top-k under the paper's budget allocation: the deterministic end of the sampling designs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.budget import expected_kept, scope_target, solve_draws
from kvpress_prob.samplers.base import Draw, Sampler, check_ratio, top_by_rank


@dataclass(kw_only=True)
class TopKSampler(Sampler):
    """Keep each head's k_h entries with the largest pi, weight 1 (no correction is needed).

    k_h is the head's expected kept count under the Poisson allocation of the scope,
    sum_i (1 - exp(-m pi_i)) with m solved as ``PoissonSampler`` solves it, rounded down (an
    epsilon of 1e-6 absorbs the solver's rounding). With ``budget="head"`` every head keeps
    int((1 - r) n), exactly kvpress's ``ScorerPress`` count, so the same scores keep kvpress's set.
    Under ``layer`` and ``global`` it isolates the allocation from the sampling (docs/method.md,
    "Decomposition"). No parameters.
    """

    def __post_init__(self):
        self.random = False

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        check_ratio(compression_ratio)
        L, b, H, n = pi.shape
        pi = pi.double()
        per_head = torch.full((L, b, H, 1), (1.0 - compression_ratio) * n, dtype=torch.float64, device=pi.device)
        target = scope_target(per_head, scope)
        m = solve_draws(pi, target, scope).expand(L, b, H, 1)
        k = torch.floor(expected_kept(pi, m) + 1e-6).long()  # (L, b, H)
        keep = top_by_rank(pi, k)
        log_weight = torch.where(keep, 0.0, float("-inf"))
        return Draw(keep=keep, log_weight=log_weight.float(), stats={"kept_per_head": k[:, 0].tolist()})
