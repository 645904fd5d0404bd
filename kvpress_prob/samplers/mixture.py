"""Defensive mixture proposals, with an optional deterministic exact set and per-head allocation.

A defensive mixture (Hesterberg, "Weighted average importance sampling and defensive mixture
distributions", Technometrics 1995; Owen and Zhou, "Safe and effective importance sampling", JASA 2000)
samples from q = (1 - lam) p + lam s, where p is the efficient proposal (here pi_min-h, the attention
of the context's last queries) and s a safe one that covers what p starves (here a query-agnostic
retrieval score: KVzip's reconstruction scores or KeyDiff's, rank-calibrated, rho_i ~ 1 / rank_i).
Since q >= (1 - lam) p and q >= lam s, no unit that either proposal favours is starved and the
weights stay bounded by 1 / (1 - lam) relative to p's and 1 / lam relative to s's.

``MixtureSampler`` reads the same (L, b, H, 2, n) pair as ``CrossStratifiedSampler`` (row 0: the
retrieval score, row 1: pi_min-h; from ``PairProposal`` or from ``KVzipSampledPress(tail=...)``), and
in each head keeps k = floor((1 - r) n) positions at most:

1. the exact set: the floor(alpha_h k / size) blocks of ``size`` positions with the largest row-0
   sums, weight 1 (alpha_h = ``alpha``, or 1 in a head whose row 0 is peaked: see ``peaked``);
2. the tail: units of ``unit`` positions (1: tokens; ``size``: the same blocks) outside the exact set,
   floor((k - |exact|) / unit) of them priority-sampled (Duffield, Lund and Thorup 2007) from the
   mixture q over those units, each kept unit's positions weighing max(q_u, t) / q_u, t the
   (m + 1)-th priority: the SNIS weights of the mixture's own inclusion probabilities given t.

Then sum_kept w_i f_i is unbiased for sum_i f_i (the exact stratum counts once, the tail is priority
sampling's unbiased subset sum), which the decode-time SNIS correction reads as log-weights.

``peaked`` (allocation per head): the statistic is the share of row 0's mass (KVzip's shifted scores,
floor included) inside the head's own top k positions, c_h in [k / n, 1]. A head with c_h >= peaked
keeps row 0's top blocks only (top-k); the others keep the ``alpha`` exact share and sample the rest.
The statistic of every head is returned in ``Draw.stats["peak_share"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpress.utils import compute_n_kept

from kvpress_prob.samplers.cross import CrossStratifiedSampler
from kvpress_prob.samplers.base import Draw, check_ratio, top_by_rank
from kvpress_prob.samplers.priority import priority_draw


def rank_calibrated(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """rho (..., n) float64: 1 / rank of each allowed score among the allowed ones of its row (rank 1 =
    largest; ties broken by position), 0 where not allowed, each row normalised to sum 1 (all zero where
    nothing is allowed)."""
    s = torch.where(allowed, scores.double(), float("-inf"))
    order = s.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(1, s.shape[-1] + 1, device=s.device).expand_as(order))
    rho = torch.where(allowed, 1.0 / ranks.double(), 0.0)
    total = rho.sum(-1, keepdim=True)
    return torch.where(total > 0, rho / total.clamp_min(1e-300), rho)


def defensive_mixture(efficient: torch.Tensor, retrieval: torch.Tensor, allowed: torch.Tensor,
                      lam: float) -> torch.Tensor:
    """q = (1 - lam) p + lam rho over the ``allowed`` units of each row: p the efficient proposal
    restricted to them and renormalised, rho the rank-calibrated retrieval scores among them. float64."""
    p = efficient.double() * allowed
    total = p.sum(-1, keepdim=True)
    p = torch.where(total > 0, p / total.clamp_min(1e-300), p)
    return (1.0 - lam) * p + lam * rank_calibrated(retrieval, allowed)


def peak_share(retrieval: torch.Tensor, k: int) -> torch.Tensor:
    """c_h (...,) float64: the share of each row's mass (..., n) inside its own k largest entries."""
    r = retrieval.double()
    if k <= 0:
        return torch.zeros(r.shape[:-1], dtype=torch.float64, device=r.device)
    return r.topk(min(k, r.shape[-1]), dim=-1).values.sum(-1) / r.sum(-1).clamp_min(1e-300)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sums over consecutive blocks of ``size`` along the last axis (the last block may be shorter)."""
    n = x.shape[-1]
    blocks = -(-n // size)
    return F.pad(x, (0, blocks * size - n)).view(*x.shape[:-1], blocks, size).sum(-1)


@dataclass(kw_only=True)
class MixtureSampler(CrossStratifiedSampler):
    """An exact set of retrieval blocks, the rest priority-sampled from a defensive mixture (see the module).

    pi (L, b, H, 2, n): row 0 the retrieval score (KVzip's or KeyDiff's pi), row 1 pi_min-h. Per-head
    budget only; every head keeps at most kvpress's count floor((1 - r) n) (exactly, when ``unit``
    divides the rest), so the cache holds at most kvpress top-k's bytes plus the correction bias.

    Parameters
    ----------
    lam : float, default 0.5
        Weight of the rank-calibrated retrieval score in the tail's mixture q = (1 - lam) pi_min-h +
        lam rho, in [0, 1]. 0 is ``CrossStratifiedSampler``'s pi_min-h tail (tokens), 1 samples the tail
        from the retrieval ranks alone.
    alpha : float, default 0.0
        Share of each head's budget kept exactly as row 0's top blocks, in [0, 1]. 0: a pure mixture.
    size : int, default 8
        Positions per exact block, >= 1.
    unit : int, default 1
        Positions per sampled tail unit: 1 (tokens) or ``size`` (the exact set's blocks, so a tail
        block never straddles the exact set).
    peaked : float or None, default None
        Allocation per head: a head whose peak share c_h (row 0's mass in its own top k) is at least
        ``peaked`` keeps row 0's top blocks for its whole budget (top-k); in (0, 1]. None: every head
        keeps the ``alpha`` share.
    """

    lam: float = 0.5
    alpha: float = 0.0
    unit: int = 1
    peaked: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.lam, bool) or not isinstance(self.lam, (int, float)) or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be a number in [0, 1], got {self.lam!r}")
        if not isinstance(self.unit, int) or self.unit not in (1, self.size):
            raise ValueError(f"unit must be 1 (tokens) or size = {self.size} (blocks), got {self.unit!r}")
        if self.peaked is not None and not 0.0 < self.peaked <= 1.0:
            raise ValueError(f"peaked must be None or in (0, 1], got {self.peaked!r}")

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        check_ratio(compression_ratio)
        if scope != "head":
            raise ValueError(f"MixtureSampler needs budget='head' (one count per head), got {scope!r}")
        if pi.dim() != 5 or pi.shape[3] != 2:
            raise ValueError(f"pi must be (L, b, H, 2, n) from a PairProposal, got shape {tuple(pi.shape)}")
        pi = pi.double()
        retrieval, efficient = pi[..., 0, :], pi[..., 1, :]  # (L, b, H, n)
        n = retrieval.shape[-1]
        k = compute_n_kept(n, compression_ratio)
        block_r = _blocks(retrieval, self.size)  # (L, b, H, blocks)
        blocks = block_r.shape[-1]
        share = peak_share(retrieval, k)  # (L, b, H)
        n_blocks = torch.full(share.shape, min(int(self.alpha * k) // self.size, blocks), dtype=torch.long,
                              device=pi.device)
        if self.peaked is not None:
            n_blocks = torch.where(share >= self.peaked, min(k // self.size, blocks), n_blocks)
        top = top_by_rank(block_r, n_blocks).repeat_interleave(self.size, dim=-1)[..., :n]  # (L, b, H, n)
        free = k - top.sum(-1)  # (L, b, H) positions left for the tail
        if self.unit == 1:
            allowed, r_units, e_units, target = ~top, retrieval, efficient, free
        else:  # tail blocks: the exact set's own blocks, so a block is wholly in or out
            allowed = ~top[..., :: self.size]  # (L, b, H, blocks)
            r_units, e_units = block_r, _blocks(efficient, self.size)
            target = free // self.size
        q = defensive_mixture(e_units, r_units, allowed, self.lam)
        sampled, log_w = priority_draw(q, target.clamp(min=0), generator)
        if self.unit != 1:
            sampled = sampled.repeat_interleave(self.size, dim=-1)[..., :n]
            log_w = log_w.repeat_interleave(self.size, dim=-1)[..., :n]
        keep = top | sampled
        log_weight = torch.where(top, 0.0, torch.where(sampled, log_w, float("-inf")))
        return Draw(keep=keep, log_weight=log_weight.float(),
                    stats={"kept_per_head": k, "exact_blocks": n_blocks[:, 0].tolist(),
                           "peak_share": share[:, 0].tolist()})


__all__ = ["MixtureSampler", "defensive_mixture", "peak_share", "rank_calibrated"]
