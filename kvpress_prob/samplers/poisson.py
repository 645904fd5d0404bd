"""Poisson draws with replacement: the paper's design.

Counts c_i ~ Poisson(m pi_i) independently. This is the paper's m i.i.d. draws with replacement
with a Poisson(m) total instead of a fixed one (given the total, the counts are multinomial); it
takes O(n) per head however large m is, and the SNIS estimate does not depend on the total. Entry
i is kept with probability q_i = 1 - exp(-m pi_i); m is solved for the budget by
``kvpress_prob.samplers.budget.solve_draws``. A kept entry's weight is c_i / (m pi_i) (E = 1), or with
``inclusion_weights`` the Horvitz-Thompson 1 / q_i = E[c_i / (m pi_i) | c_i > 0].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.samplers.budget import expected_kept, inclusion_probability, scope_target, solve_draws
from kvpress_prob.samplers.base import Draw, Sampler, exact_top, head_target, renormalise


def sinks_and_window(n: int, n_sink: int, window: int, device) -> torch.Tensor:
    """(n,) bool: the first ``n_sink`` and last ``window`` positions."""
    fixed = torch.zeros(n, dtype=torch.bool, device=device)
    fixed[: min(n_sink, n)] = True
    if window > 0:
        fixed[max(0, n - window) :] = True
    return fixed


def poisson_sample(
    pi: torch.Tensor,
    m: torch.Tensor,
    generator: torch.Generator | None = None,
    coordinated: bool = False,
    inclusion_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw the sampled stratum: pi (L, b, H, n), m broadcastable to (L, b, H, 1) (inf = keep all).

    Returns (kept (L, b, H, n) bool, log-weights (L, b, H, n) float64, meaningful where kept):
    log(c_i / (m pi_i)) for independent counts, or -log q_i for coordinated sampling and for
    ``inclusion_weights=True``.
    """
    pi = pi.double()
    m = torch.as_tensor(m, dtype=torch.float64, device=pi.device).expand(*pi.shape[:-1], 1)
    finite = torch.isfinite(m)
    if coordinated:  # one uniform per position, shared by every layer and head
        u = torch.rand(pi.shape[1], pi.shape[-1], generator=generator, device=pi.device, dtype=torch.float64)
        q = inclusion_probability(pi, m)
        return u[None, :, None, :] < q, -torch.log(q)
    rate = torch.where(finite, m, torch.zeros_like(m)) * pi  # (L, b, H, n)
    counts = torch.poisson(rate, generator=generator)
    kept = (counts > 0) | (~finite & (pi > 0))
    if inclusion_weights:
        return kept, -torch.log(inclusion_probability(pi, m))
    return kept, torch.where(finite, torch.log(counts) - torch.log(rate), torch.zeros_like(rate))


@dataclass(kw_only=True)
class PoissonSampler(Sampler):
    """The paper's sampling design: counts c_i ~ Poisson(m pi_i), keep what was drawn, weight
    c_i / (m pi_i) (Geh et al., "A Probabilistic Interpretation of KV Cache Eviction", 2026).

    Parameters
    ----------
    n_sink, window : int, default 0
        Sinks and window (beyond the paper): the first ``n_sink`` and last ``window`` positions are
        kept in every head with weight 1; they count against the budget.
    alpha : float, default 0.0
        Exact top stratum (beyond the paper), in [0, 1): the top ``alpha`` fraction of each head's
        allocation, by pi, is kept with weight 1 and the rest sampled from pi restricted to the
        remainder. 0 is the paper; a full top-k is ``TopKSampler``.
    coordinated : bool, default False
        Coordinated sampling (beyond the paper): one uniform per position shared by every layer and
        head, so a token tends to be kept everywhere or nowhere. Weights 1 / q_i.
    inclusion_weights : bool, default False
        Horvitz-Thompson weights 1 / q_i, q_i = 1 - exp(-m pi_i), instead of c_i / (m pi_i): the
        count weight averaged over the counts that give the same kept set, unbiased too and free of
        the Poisson noise of c_i on entries drawn many times.
    """

    n_sink: int = 0
    window: int = 0
    alpha: float = 0.0
    coordinated: bool = False
    inclusion_weights: bool = False

    def __post_init__(self):
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1) (a full top-k is TopKSampler), got {self.alpha}")
        if self.n_sink < 0 or self.window < 0:
            raise ValueError(f"n_sink and window must be >= 0, got {self.n_sink} and {self.window}")

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        L, b, H, n = pi.shape
        pi = pi.double()
        fixed = sinks_and_window(n, self.n_sink, self.window, pi.device)
        n_fixed = int(fixed.sum())
        per_head = head_target(pi, compression_ratio, n_fixed)  # (L, b, H, 1): sampled entries per head
        if bool((per_head < 0).any()):
            raise ValueError(f"n_sink + window = {n_fixed} exceed the kept budget (1 - compression_ratio) * n = "
                             f"{(1.0 - compression_ratio) * n:.1f}")
        pi_rest = renormalise(pi, ~fixed)
        m = solve_draws(pi_rest, scope_target(per_head, scope), scope)  # the scope's group shape
        exact = fixed.expand(L, b, H, n)
        if self.alpha > 0:
            k = expected_kept(pi_rest, m.expand(L, b, H, 1))  # (L, b, H): each head's allocation
            a = torch.round(self.alpha * k).long()
            top, pi_rest = exact_top(pi_rest, a)
            exact = exact | top
            m = solve_draws(pi_rest, (k - a).clamp_min(0).unsqueeze(-1), "head")
        m = m.expand(L, b, H, 1)
        sampled, log_w = poisson_sample(pi_rest, m, generator, self.coordinated, self.inclusion_weights)
        keep = exact | sampled
        log_weight = torch.where(exact, 0.0, torch.where(sampled, log_w, float("-inf")))
        expected = exact.sum() + expected_kept(pi_rest, m).sum()  # sum over L, b, H of sum_i P(kept_i)
        return Draw(keep=keep, log_weight=log_weight.float(),
                    stats={"m": summarise_scale(m[..., 0]), "expected_kept": float(expected)})


def summarise_scale(m: torch.Tensor) -> float | list:
    """A per-head scale (L, b, H) as one number when it is shared, else a per-layer, per-head list."""
    first = m.flatten()[0]
    if bool((m == first).all()):
        return float(first)
    return m[:, 0].tolist()
