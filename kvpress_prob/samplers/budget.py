"""The budget: how many draws m so that the expected kept count meets (1 - r) of the prefix.

Draw counts are Poisson: c_i ~ Poisson(m pi_i) independently (see ``sampling``), so entry i is
kept with probability q_i = 1 - exp(-m pi_i) and a head keeps sum_i q_i entries in expectation.
That is increasing and concave in m, so m is found by Newton's method started below the root
(see ``solve_draws``), per group of heads:

- ``global``: one m for every layer and head (each head spends by its own distribution);
- ``layer``: one m per layer;
- ``head``: one m per head (a fixed expected kept count per head).
"""

from __future__ import annotations

import torch

SCOPES = ("global", "layer", "head")


def inclusion_probability(pi: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q = 1 - exp(-m pi): probability that a Poisson(m pi) count is positive (0 where pi = 0)."""
    q = -torch.expm1(-m * pi)
    return q.nan_to_num(0.0) if torch.isinf(m).any() else q  # inf * 0 where pi = 0


def scope_target(per_head: torch.Tensor, scope: str) -> torch.Tensor:
    """Per-head targets (L, b, H, 1) summed over the heads that share one scale in ``scope``."""
    if scope not in SCOPES:
        raise ValueError(f"budget must be one of {SCOPES}, got {scope!r}")
    return {"global": per_head.sum((0, 2), keepdim=True), "layer": per_head.sum(2, keepdim=True), "head": per_head}[scope]


def _group_sum(x: torch.Tensor, scope: str) -> torch.Tensor:
    """x (L, b, H, n) -> sums over the dimensions one m is shared by, kept for broadcasting."""
    dims = {"global": (0, 2, 3), "layer": (2, 3), "head": (3,)}[scope]
    return x.sum(dim=dims, keepdim=True)


def solve_draws(
    pi: torch.Tensor, target: torch.Tensor, scope: str, iterations: int = 100, rtol: float = 1e-10
) -> torch.Tensor:
    """m such that the expected kept count of each group equals ``target``.

    pi (L, b, H, n): one distribution per head (0 on entries that cannot be drawn);
    target: expected kept entries per group, broadcastable to the group sums of ``scope``
    ((1, b, 1, 1) global, (L, b, 1, 1) layer, (L, b, H, 1) head).
    Returns m with the group shape; +inf where the target is every drawable entry, 0 where it is 0.

    Newton's method on f(m) = sum (1 - exp(-m pi)) - target, which is increasing and concave in m,
    started from the lower bound target / sum(pi) (1 - e^-x <= x): every tangent step stays below
    the root, so the iterates increase monotonically to it (a few to twenty steps in practice).
    """
    if scope not in SCOPES:
        raise ValueError(f"budget must be one of {SCOPES}, got {scope!r}")
    pi = pi.double()
    drawable = _group_sum((pi > 0).double(), scope)
    target = torch.as_tensor(target, dtype=torch.float64, device=pi.device).expand_as(drawable)
    feasible = (target > 0) & (target < drawable)
    goal = torch.where(feasible, target, torch.zeros_like(target))
    m = goal / _group_sum(pi, scope).clamp_min(1e-300)
    for _ in range(iterations):
        e = torch.exp(-m * pi)
        gap = goal - _group_sum(1.0 - e, scope)  # >= 0: below the root
        if bool((gap <= rtol * goal.clamp_min(1.0)).all()):
            break
        slope = _group_sum(pi * e, scope).clamp_min(1e-300)
        m = m + torch.where(feasible, gap / slope, torch.zeros_like(m))
    m = torch.where(target >= drawable, torch.full_like(m, float("inf")), m)
    return torch.where(target <= 0, torch.zeros_like(m), m)


def expected_kept(pi: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Expected kept count per head: sum_i (1 - exp(-m pi_i)). pi (..., n), m (..., 1) -> (...)."""
    return inclusion_probability(pi.double(), m.double()).sum(dim=-1)


def threshold_inclusion(pi: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """q = min(1, c pi): the inclusion probabilities of threshold (pi-ps) sampling."""
    return (c * pi).clamp(max=1.0)


def solve_threshold(
    pi: torch.Tensor, target: torch.Tensor, scope: str, floor: torch.Tensor | None = None, iterations: int = 200
) -> torch.Tensor:
    """c such that sum_i min(1, max(c, floor_h) pi_i) over each group of ``scope`` equals ``target``.

    pi (L, b, H, n); target broadcastable to the group shape ((1, b, 1, 1) global, (L, b, 1, 1)
    layer, (L, b, H, 1) head); ``floor`` (L, b, H, 1), optional: a per-head lower bound on c (the
    allocation floor). The group's kept count is continuous and non-decreasing in c, so c is found
    by bisection in log c, to a relative 1e-12. Returns c with the group shape, +inf where the
    target is every drawable entry.
    """
    if scope not in SCOPES:
        raise ValueError(f"budget must be one of {SCOPES}, got {scope!r}")
    pi = pi.double()
    floor = torch.zeros(*pi.shape[:-1], 1, dtype=torch.float64, device=pi.device) if floor is None else floor

    def kept(c):
        return _group_sum(threshold_inclusion(pi, torch.maximum(c, floor)), scope)

    drawable = _group_sum((pi > 0).double(), scope)
    target = torch.as_tensor(target, dtype=torch.float64, device=pi.device).expand_as(drawable)
    smallest = pi.masked_fill(pi <= 0, float("inf")).amin()
    hi = torch.full_like(drawable, 1.0 / float(smallest.clamp_min(1e-300)))  # keeps every drawable entry
    lo = torch.full_like(drawable, 1e-300)
    for _ in range(iterations):
        mid = torch.sqrt(lo * hi)
        below = kept(mid) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        if bool(((hi / lo) < 1 + 1e-12).all()):
            break
    c = hi
    c = torch.where(target >= drawable, torch.full_like(c, float("inf")), c)
    return torch.where(target <= 0, torch.zeros_like(c), c)
