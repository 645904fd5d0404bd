"""The budget: how many draws m so that the expected kept count meets (1 - r) of the prefix.

Draw counts are Poisson: c_i ~ Poisson(m pi_i) independently (see ``sampling``), so entry i is
kept with probability q_i = 1 - exp(-m pi_i) and a head keeps sum_i q_i entries in expectation.
That is increasing in m, so m is found by bisection (in log m), per group of heads:

- ``global``: one m for every layer and head (each head spends by its own distribution);
- ``layer``: one m per layer;
- ``head``: one m per head (a fixed expected budget per head).
"""

from __future__ import annotations

import torch

SCOPES = ("global", "layer", "head")


def inclusion_probability(pi: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q = 1 - exp(-m pi): probability that a Poisson(m pi) count is positive (0 where pi = 0)."""
    return torch.where(pi > 0, -torch.expm1(-m * pi), torch.zeros_like(pi))


def _group_sum(x: torch.Tensor, scope: str) -> torch.Tensor:
    """x (L, b, H, n) -> sums over the dimensions one m is shared by, kept for broadcasting."""
    dims = {"global": (0, 2, 3), "layer": (2, 3), "head": (3,)}[scope]
    return x.sum(dim=dims, keepdim=True)


def solve_draws(
    pi: torch.Tensor, target: torch.Tensor, scope: str, iterations: int = 100
) -> torch.Tensor:
    """m such that the expected kept count of each group equals ``target``.

    pi (L, b, H, n): one distribution per head (0 on entries that cannot be drawn);
    target: expected kept entries per group, broadcastable to the group sums of ``scope``
    ((1, b, 1, 1) global, (L, b, 1, 1) layer, (L, b, H, 1) head).
    Returns m with the group shape; +inf where the target is every drawable entry, 0 where it is 0.
    """
    if scope not in SCOPES:
        raise ValueError(f"budget must be one of {SCOPES}, got {scope!r}")
    pi = pi.double()
    drawable = _group_sum((pi > 0).double(), scope)
    target = torch.as_tensor(target, dtype=torch.float64, device=pi.device).expand_as(drawable)
    lo = torch.full_like(drawable, -30.0)  # log m
    hi = torch.full_like(drawable, 40.0)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        kept = _group_sum(inclusion_probability(pi, mid.exp()), scope)
        below = kept < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    m = ((lo + hi) / 2).exp()
    m = torch.where(target >= drawable, torch.full_like(m, float("inf")), m)
    return torch.where(target <= 0, torch.zeros_like(m), m)


def expected_kept(pi: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Expected kept count per head: sum_i (1 - exp(-m pi_i)). pi (..., n), m (..., 1) -> (...)."""
    return inclusion_probability(pi.double(), m.double()).sum(dim=-1)
