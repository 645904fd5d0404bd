"""Calibrated proposals: scorer scores mapped to pi by rank, or by an entropy-matched softmax.

``ScoreProposal`` maps scores to pi by shift-and-normalise, pi_i ~ s_i - min_j s_j. For scorers
whose scores sit in a narrow band far from their minimum (KeyDiff's negative cosine similarity,
ExpectedAttention's expected attention times value norm), that pi is close to uniform, so a sampler
drawing from it keeps a near-uniform random subset. ``CalibratedProposal`` keeps the scorer's order
and chooses how peaked pi is:

- ``calibration="rank"``: pi_i ~ 1 / rank_i (Zipf over the scorer's ranking, rank 1 = best score);
  its shape does not depend on the scores' scale at all.
- ``calibration="entropy"``: pi = softmax(z / T), z the scores standardised per head, with the
  temperature T of each KV head chosen so that H(pi) equals the entropy of the attention the scorer
  stands for: the mean attention of the prefix's last ``query_window`` queries, measured at the
  hook (the mean over the KV head's query heads of each query head's entropy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpress_prob.proposals.base import ScoreProposal
from kvpress_prob.proposals.attention import attention_mass, rope_queries, row_weights

CALIBRATIONS = ("rank", "entropy")


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of distributions p (..., n) over the last axis (0 log 0 = 0)."""
    p = p.double()
    return -(p * torch.log(p.clamp_min(1e-300))).sum(-1)


def rank_weights(scores: torch.Tensor) -> torch.Tensor:
    """1 / rank of each score within its row (rank 1 = largest; ties broken by position): (..., n)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(1, scores.shape[-1] + 1, device=scores.device)
                                             .expand_as(order))
    return 1.0 / ranks.double()


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """(s - mean) / std per row (..., n), float64; a constant row becomes all zeros."""
    s = scores.double()
    centred = s - s.mean(-1, keepdim=True)
    std = centred.pow(2).mean(-1, keepdim=True).sqrt()
    return torch.where(std > 0, centred / std.clamp_min(1e-300), torch.zeros_like(centred))


def match_temperature(z: torch.Tensor, target: torch.Tensor, low: float = 1e-3, high: float = 1e3,
                      steps: int = 50) -> torch.Tensor:
    """T (...,) with H(softmax(z / T)) = target (...,) for rows z (..., n), by bisection on log T.

    H(softmax(z / T)) increases with T (from the entropy of the argmax set to log n), so the
    bisection converges; a target outside [H(low), H(high)] gives the nearest end of the bracket.
    """
    lo = torch.full(target.shape, math.log(low), dtype=torch.float64, device=z.device)
    hi = torch.full(target.shape, math.log(high), dtype=torch.float64, device=z.device)
    target = target.double()
    for _ in range(steps):
        mid = (lo + hi) / 2
        h = entropy(torch.softmax(z / mid.exp()[..., None], dim=-1))
        too_flat = h > target
        hi = torch.where(too_flat, mid, hi)
        lo = torch.where(too_flat, lo, mid)
    return ((lo + hi) / 2).exp()


def window_entropy(module, hidden_states, keys, kwargs, query_window: int, chunk_size: int) -> torch.Tensor:
    """Entropy (b, H_kv) of the mean attention of the last ``query_window`` prefix queries: each
    query head's mean attention row, its entropy, averaged over the KV head's query heads."""
    b, hkv, n, d = keys.shape
    h, start = row_weights(n, "uniform", query_window, keys.device)
    rows = torch.arange(start, n, device=keys.device)
    queries = rope_queries(module, hidden_states, kwargs["position_embeddings"], rows=rows)  # (b, H_q, s, d)
    scaling = getattr(module, "scaling", 1.0 / math.sqrt(d))
    mass = attention_mass(queries, rows, keys, h, scaling, chunk_size)  # (b, H_q, n), rows sum to 1
    return entropy(mass).view(b, hkv, -1).mean(-1)


@dataclass(kw_only=True)
class CalibratedProposal(ScoreProposal):
    """Proposal from a kvpress ``ScorerPress`` whose shape is calibrated (beyond the paper).

    The scorer's order is kept; ``calibration`` decides how much mass the best-scored entries get
    (module docstring). The base class's sharpness, head sharing and uniform floor apply after it.

    Parameters
    ----------
    scorer : kvpress ScorerPress
        Gives (batch, kv_heads, n) scores (never written; ``ScoreProposal.at_ratio``).
    calibration : {"rank", "entropy"}, default "entropy"
        "rank": pi_i ~ 1 / rank_i. "entropy": softmax of the standardised scores at the temperature
        whose entropy matches the window queries' attention, per KV head.
    query_window : int, default 64
        Number of last prefix queries whose attention sets the target entropy, >= 1.
    chunk_size : int, default 512
        Query rows per chunk when computing that attention.
    """

    calibration: str = "entropy"
    query_window: int = 64
    chunk_size: int = 512

    def __post_init__(self):
        super().__post_init__()
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if self.query_window < 1:
            raise ValueError(f"query_window must be >= 1, got {self.query_window}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    def weights(self, module, hidden_states, keys, values, kwargs):
        scores = self.scorer.score(module, hidden_states, keys, values, None, kwargs).float()  # (b, H_kv, n)
        if not torch.isfinite(scores).all():
            raise ValueError("scores must be finite (the scorer returned NaN or Inf)")
        if self.calibration == "rank":
            return rank_weights(scores).float()
        target = window_entropy(module, hidden_states, keys, kwargs, self.query_window, self.chunk_size)  # (b, H_kv)
        z = standardise(scores)
        temperature = match_temperature(z, target)  # (b, H_kv)
        return torch.softmax(z / temperature[..., None], dim=-1).float()
