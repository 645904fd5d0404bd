"""Proposal distributions over the prefix of one layer, one per KV head.

A proposal maps one layer's prefill state (module, hidden states, keys, values, the forward kwargs
with the position embeddings) to a tensor pi of shape (batch, kv_heads, n): finite, strictly
positive, summing to 1 over the n prefix positions. The sampling press draws the kept entries
from it (docs/method.md, "Proposals").

Every proposal ends with the same steps (``Proposal.__call__``):
- optional sharpening: pi <- pi^beta / sum pi^beta;
- optional head sharing: the mean over the layer's KV heads, shared by all of them;
- a uniform floor: pi <- (1 - floor) * pi + floor / n, so that every entry can be drawn.

Grouped-query attention: a KV head's proposal is the mean of its query heads' proposals, each
normalised first, so every query head's support is covered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half


@dataclass(kw_only=True)
class Proposal:
    """Base class. Subclasses implement ``weights`` (non-negative, any scale).

    Parameters
    ----------
    floor : float, default 0.01
        Mass of the uniform component mixed in, in [0, 1): every entry has pi_i >= floor / n.
    head_shared : bool, default False
        Share one proposal (the mean over the layer's KV heads) across all KV heads of the layer.
    sharpness : float, default 1.0
        beta > 0: pi is taken proportional to pi^beta before the floor (beyond the paper). 1 is the
        paper; large beta tends to a top-k of the same scores, small beta to uniform.
    """

    floor: float = 0.01
    head_shared: bool = False
    sharpness: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"floor must be in [0, 1), got {self.floor}")
        if not (self.sharpness > 0 and math.isfinite(self.sharpness)):
            raise ValueError(f"sharpness must be a finite number > 0, got {self.sharpness}")

    def weights(self, module: nn.Module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, module: nn.Module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        w = self.weights(module, hidden_states, keys, values, kwargs).float()  # (b, H_kv, n)
        pi = normalise(w, name=f"{type(self).__name__} weights")
        if self.sharpness != 1.0:  # pi^beta / sum pi^beta, computed from the log to stay finite
            pi = torch.softmax(self.sharpness * torch.log(pi.double()), dim=-1).float()
        if self.head_shared:
            pi = pi.mean(dim=1, keepdim=True).expand_as(pi).contiguous()
        n = pi.shape[-1]
        return (1.0 - self.floor) * pi + self.floor / n


def normalise(w: torch.Tensor, name: str = "weights") -> torch.Tensor:
    """w (..., n) finite, >= 0, each row with a positive sum -> rows summing to 1. Else ValueError."""
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} must be finite (got NaN or Inf)")
    if (w < 0).any():
        raise ValueError(f"{name} must be non-negative (got a minimum of {w.min().item():.3g})")
    total = w.sum(dim=-1, keepdim=True)
    if (total <= 0).any():
        raise ValueError(f"{name} must have a positive sum for every head (got an all-zero row)")
    return w / total


def scores_to_weights(scores: torch.Tensor) -> torch.Tensor:
    """Map scorer scores (b, H_kv, n), any sign, to non-negative weights by shift: s - min_i s.

    A constant row (no information) becomes uniform. NaN / Inf and all-zero rows are errors.
    """
    scores = scores.float()
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite (the scorer returned NaN or Inf)")
    if (scores == 0).all(dim=-1).any():
        raise ValueError("scores are all zero for a head: the scorer gives no information to sample from")
    shifted = scores - scores.amin(dim=-1, keepdim=True)
    flat = shifted.sum(dim=-1, keepdim=True) == 0
    return torch.where(flat, torch.ones_like(shifted), shifted)


@dataclass(kw_only=True)
class ScoreProposal(Proposal):
    """Proposal from any kvpress ``ScorerPress``: pi = floor-mix of (s - min s) / sum (s - min s).

    The shift maps negative scores (K-norm: -||k||) and 0/1 scores (StreamingLLM) to weights that
    keep the scorer's order; the entry with the lowest score gets only the floor mass.

    Parameters
    ----------
    scorer : kvpress ScorerPress
        Its ``score`` gives (batch, kv_heads, n) scores. Its ``compression_ratio`` is set to the
        press's by ``SamplingPress`` (StreamingLLM's scores depend on it).
    """

    scorer: ScorerPress

    def weights(self, module, hidden_states, keys, values, kwargs):
        scores = self.scorer.score(module, hidden_states, keys, values, None, kwargs)
        return scores_to_weights(scores)


def rope_queries(module: nn.Module, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
    """Queries of the prefill with RoPE, as the attention module computes them: (b, H_q, n, d)."""
    q = get_prerope_query_states(module, hidden_states)
    cos, sin = position_embeddings
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def row_weights(n: int, rows: str, query_window: int | None, device) -> tuple[torch.Tensor, int]:
    """Weights of the query rows j = start..n-1 and start. rows in {"last", "uniform", "harmonic"}."""
    if rows == "last":
        return torch.ones(1, device=device), n - 1
    start = 0 if query_window is None else max(0, n - query_window)
    j = torch.arange(start, n, device=device, dtype=torch.float32)
    h = torch.ones_like(j) if rows == "uniform" else 1.0 / (n - j)  # harmonic: 1 / (t - j + 1)
    return h / h.sum(), start


def attention_mass(
    queries: torch.Tensor, keys: torch.Tensor, h: torch.Tensor, start: int, scaling: float, chunk_size: int
) -> torch.Tensor:
    """sum_j h_j softmax_causal(q_j . k / sqrt d) for the rows j = start.. (b, H_q, n), in chunks.

    queries (b, H_q, n, d) with RoPE, keys (b, H_kv, n, d), h (n - start,). Never more than one
    (b, H_q, chunk_size, n) float32 buffer of scores in memory at once (exponentiated in place).
    """
    b, hq, n, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    k = keys.float().transpose(2, 3)  # (b, H_kv, d, n)
    mass = torch.zeros(b, hkv, g, 1, n, device=keys.device, dtype=torch.float32)
    positions = torch.arange(n, device=keys.device)
    for lo in range(start, n, chunk_size):
        hi = min(n, lo + chunk_size)  # rows lo..hi-1 see keys 0..hi-1 only (causal)
        q = queries[:, :, lo:hi].float().reshape(b, hkv, g * (hi - lo), d)  # query heads of a group stacked
        e = torch.matmul(q, k[..., :hi]).mul_(scaling).view(b, hkv, g, hi - lo, hi)  # (b, H_kv, g, c, hi)
        e.masked_fill_(positions[None, :hi] > positions[lo:hi, None], float("-inf"))
        e.sub_(e.amax(dim=-1, keepdim=True)).exp_()  # softmax numerators, in place
        w = h[lo - start : hi - start] / e.sum(dim=-1)  # (b, H_kv, g, c): h_j / softmax denominator
        mass[..., :hi] += torch.matmul(w[..., None, :], e)  # (b, H_kv, g, 1, hi)
    return mass.view(b, hq, n)


def chunk_rows(keys: torch.Tensor, n_query_heads: int, n_layers: int, fraction: float = 1 / 32) -> int:
    """Query rows per chunk such that one (b, H_q, rows, n) float32 buffer is at most ``fraction``
    of the model's full K+V (n_layers * 2 * b * H_kv * n * d * element size, from one layer's
    ``keys``): the rows do not depend on n, since both grow with it."""
    b, hkv, n, d = keys.shape
    kv_bytes = n_layers * 2 * b * hkv * n * d * keys.element_size()
    return max(1, int(fraction * kv_bytes / (b * n_query_heads * n * 4)))


@dataclass(kw_only=True)
class AttentionProposal(Proposal):
    """Shared machinery of the proposals computed from recomputed prefill queries (sdpa-friendly).

    A subclass sets ``plain_rows`` (which attention rows are mixed without the harmonic prior:
    "last", the last prefix query only, or "uniform", all rows equally as H2O's cumulative
    attention) and ``value_norm`` (multiply the attention mass by ||v_i||, as pi_min, or not).

    Parameters
    ----------
    harmonic : bool, default False
        Mix the rows j <= t with the harmonic prior h_j ~ 1 / (t - j + 1) instead.
    centred : bool
        Use ||v_i - o|| with o the attention output of the same rows (SNIS-optimal centring).
    query_window : int, optional
        Only the last ``query_window`` query rows enter ("uniform" / "harmonic"); None = all rows.
    chunk_size : int, optional
        Query rows per chunk of the O(n^2) computation. None (default): as many as keep the chunk's
        float32 scores within 1/32 of the model's K+V (``chunk_rows``; 40 rows for SmolLM2-135M in
        float32, 37 for Llama-3.2-3B in bfloat16).
    """

    plain_rows: ClassVar[str] = "last"
    value_norm: ClassVar[bool] = True
    harmonic: bool = False
    centred: bool = False
    query_window: int | None = None
    chunk_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.query_window is not None and self.query_window < 1:
            raise ValueError(f"query_window must be None or >= 1, got {self.query_window}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be None or >= 1, got {self.chunk_size}")

    @property
    def rows(self) -> str:
        return "harmonic" if self.harmonic else self.plain_rows

    def weights(self, module, hidden_states, keys, values, kwargs):
        b, hkv, n, d = keys.shape
        queries = rope_queries(module, hidden_states, kwargs["position_embeddings"])
        h, start = row_weights(n, self.rows, self.query_window, keys.device)
        scaling = getattr(module, "scaling", 1.0 / math.sqrt(d))
        rows = self.chunk_size or chunk_rows(keys, queries.shape[1], module.config.num_hidden_layers)
        mass = attention_mass(queries, keys, h, start, scaling, rows)  # (b, H_q, n)
        g = mass.shape[1] // hkv
        mass = mass.view(b, hkv, g, n)
        if self.value_norm:
            v = values.float()[:, :, None]  # (b, H_kv, 1, n, d)
            if self.centred:
                o = torch.einsum("bhgn,bhnd->bhgd", mass, values.float())  # (b, H_kv, g, d)
                norms = torch.linalg.vector_norm(v - o[:, :, :, None], dim=-1)  # (b, H_kv, g, n)
            else:
                norms = torch.linalg.vector_norm(v, dim=-1)  # (b, H_kv, 1, n)
            mass = mass * norms
        # normalise per query head, then mix the group: (b, H_kv, n)
        return normalise(mass, name=f"{type(self).__name__} weights").mean(dim=2)


@dataclass(kw_only=True)
class MinVarianceProposal(AttentionProposal):
    """pi_min (harmonic=False): p_t(i) ||v_i||, p_t the attention row of the last prefix query.

    pi_min-h (harmonic=True): sum_j h_j p_j(i) ||v_i|| with h_j ~ 1 / (t - j + 1) over the prefix
    rows (docs/method.md, "Proposals"), computed in query chunks. ``centred=True`` uses ||v_i - o||.
    Geh et al., "A Probabilistic Interpretation of KV Cache Eviction" (2026).

    Parameters: those of ``AttentionProposal`` (harmonic, centred, query_window, chunk_size) and
    ``Proposal`` (floor, head_shared).
    """

    plain_rows: ClassVar[str] = "last"
    value_norm: ClassVar[bool] = True


@dataclass(kw_only=True)
class H2OProposal(AttentionProposal):
    """pi_H2O: normalised cumulative attention sum_j p_j(i) (H2O, Zhang et al. 2023) on sdpa.

    harmonic=True weighs the rows with h_j ~ 1 / (t - j + 1) (pi_H2O-h). Unlike kvpress's
    ObservedAttentionPress it needs no eager attention: the rows are recomputed in chunks.

    Parameters: those of ``AttentionProposal`` (harmonic, query_window, chunk_size; centred is
    unused without value norms) and ``Proposal`` (floor, head_shared).
    """

    plain_rows: ClassVar[str] = "uniform"
    value_norm: ClassVar[bool] = False
