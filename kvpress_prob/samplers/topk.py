"""Top-k under the paper's budget allocation: the deterministic end of the sampling designs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.samplers.budget import expected_kept, scope_target, solve_draws
from kvpress_prob.samplers.base import Draw, Sampler, head_target, top_by_rank, whole_counts


@dataclass(kw_only=True)
class TopKSampler(Sampler):
    """Keep each head's k_h entries with the largest pi, weight 1 (no correction is needed).

    The allocation is each head's expected kept count under the Poisson allocation of the scope,
    sum_i (1 - exp(-m pi_i)) with m solved as ``PoissonSampler`` solves it, made whole by
    ``whole_counts`` (the scope keeps the floor of its budget in all). With ``budget="head"`` every
    head keeps int((1 - r) n), exactly kvpress's ``ScorerPress`` count, so the same scores keep
    kvpress's set. Under ``layer`` and ``global`` it isolates the allocation from the sampling
   . No parameters.
    """

    def __post_init__(self):
        self.random = False
        self.whole_count = True

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        pi = pi.double()
        target = scope_target(head_target(pi, compression_ratio), scope)
        m = solve_draws(pi, target, scope).expand(*pi.shape[:-1], 1)
        k = whole_counts(expected_kept(pi, m), scope, pi.shape[-1], compression_ratio).clamp(max=pi.shape[-1])  # (L, b, H)
        keep = top_by_rank(pi, k)
        log_weight = torch.where(keep, 0.0, float("-inf"))
        return Draw(keep=keep, log_weight=log_weight.float(), stats={"kept_per_head": k[:, 0].tolist()})
