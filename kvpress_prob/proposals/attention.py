"""Attention proposals: pi from the prefill's own attention (H2O's accumulated attention, the
minimum-variance proposal pi_min and its sampled-rows variant), and the query and row helpers they share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from kvpress_prob.proposals import precision


from kvpress_prob.proposals.base import Proposal, normalise


def rope_queries(module: nn.Module, hidden_states: torch.Tensor, position_embeddings,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """Queries of the prefill with RoPE, as the attention module computes them: (b, H_q, n, d).

    ``rows`` (s,) positions: only those rows are projected, (b, H_q, s, d)."""
    cos, sin = position_embeddings  # (b, n, d_head)
    if rows is not None:
        hidden_states, cos, sin = hidden_states[:, rows], cos[:, rows], sin[:, rows]
    q = get_prerope_query_states(module, hidden_states)
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def row_weights(n: int, rows: str, query_window: int | None, device) -> tuple[torch.Tensor, int]:
    """Weights of the query rows j = start..n-1 and start. rows in {"last", "uniform", "harmonic"}."""
    if rows == "last":
        return torch.ones(1, device=device), n - 1
    start = 0 if query_window is None else max(0, n - query_window)
    j = torch.arange(start, n, device=device, dtype=torch.float32)
    h = torch.ones_like(j) if rows == "uniform" else 1.0 / (n - j)  # harmonic: 1 / (t - j + 1)
    return h / h.sum(), start


def segment_rows(h: torch.Tensor, s: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An unbiased s-row sample of the mixture sum_j h_j p_j: (rows (k,), weights (k,)), k <= s.

    h (N,) >= 0, summing to 1 (the rows' prior, in position order). Returns row indices in
    increasing order and weights such that E[sum_r weight_r p_{row_r}] = sum_j h_j p_j for any rows
    p_j, and sum_r weight_r = sum_j h_j exactly:
    - certainty rows: the w heaviest rows, w the smallest count such that every other row weighs less
      than (rest mass) / (s - w); each is taken with its own weight h_j;
    - the other rows, in position order, are cut into s - w contiguous segments of equal h-mass (a row
      goes to the segment holding the start of its mass interval); from each segment S one row is
      drawn with probability h_j / h(S) and weighs h(S).
    s >= N (or segments of one row each) takes every row with weight h_j: the exact mixture.
    Computed on the CPU in float64 from ``generator`` (a CPU generator): the same seed, the same rows
    on any device.
    """
    if s < 1:
        raise ValueError(f"the number of sampled rows s must be >= 1, got {s}")
    h = h.detach().to("cpu", torch.float64)
    n_rows = h.numel()
    if s >= n_rows:
        return torch.arange(n_rows), h
    order = torch.argsort(h, descending=True, stable=True)  # heaviest first (harmonic: most recent)
    sorted_h = h[order]
    rest_mass = sorted_h.flip(0).cumsum(0).flip(0)  # rest_mass[w] = mass of sorted rows w..N-1
    w = torch.arange(s)
    fits = (s - w) * sorted_h[:s] < rest_mass[:s] * (1 - 1e-12)  # the heaviest remaining row below a segment
    w = int(fits.to(torch.int8).argmax()) if bool(fits.any()) else s
    if w == s:  # only if the rows beyond the s heaviest weigh 0: those s rows are the exact mixture
        rows = order[:s].sort().values
        return rows, h[rows]
    certain = order[:w]
    rest = order[w:].sort().values  # position order: segments are contiguous in recency
    m = s - w
    h_rest = h[rest]
    end = h_rest.cumsum(0)  # end of each row's mass interval
    begin = end - h_rest
    segment = torch.clamp((begin / end[-1] * m).floor().long(), max=m - 1)  # (N - w,)
    mass = torch.zeros(m, dtype=torch.float64).index_add_(0, segment, h_rest)  # h(S) per segment
    index = torch.arange(rest.numel())
    first = torch.full((m,), rest.numel(), dtype=torch.long).scatter_reduce_(0, segment, index, "amin")
    last = torch.full((m,), -1, dtype=torch.long).scatter_reduce_(0, segment, index, "amax")
    u = torch.rand(m, generator=generator, dtype=torch.float64)  # one uniform per segment, drawn even if empty
    used = last >= 0
    first, last, mass, u = first[used], last[used], mass[used], u[used]
    point = begin[first] + u * mass  # inverse CDF of h inside the segment
    pick = torch.searchsorted(end, point, right=True).clamp(min=first, max=last)
    rows = torch.cat([rest[pick], certain])
    weights = torch.cat([mass, h[certain]])
    rows, at = rows.sort()
    return rows, weights[at]


@torch.no_grad()  # a proposal, never differentiated: its buffer is written in place (matmul out=)
def attention_mass(
    queries: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, h: torch.Tensor, scaling: float, chunk_size: int
) -> torch.Tensor:
    """sum_r h_r softmax_causal(q_r . k / sqrt d) over the query rows r: (b, H_q, n), in chunks.

    queries (b, H_q, s, d) with RoPE, the queries of the positions ``rows`` (s,) (increasing), keys
    (b, H_kv, n, d), h (s,). One (b, H_q, chunk_size, n) float32 buffer of scores, allocated once and reused
    by every chunk (exponentiated in place). The queries are scaled once (not the scores), and only a chunk's
    diagonal block, the keys after its first row, is masked.
    """
    b, hq, s, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    k = keys.float().transpose(2, 3)  # (b, H_kv, d, n)
    queries = queries.float() * scaling  # (b, H_q, s, d)
    mass = torch.zeros(b, hkv, g, 1, n, device=keys.device, dtype=torch.float32)
    positions = torch.arange(n, device=keys.device)
    rows = rows.to(keys.device)
    h = h.to(device=keys.device, dtype=torch.float32)
    ends = (rows + 1).tolist()
    buffer = torch.empty(b * hq * min(s, chunk_size) * n, device=keys.device, dtype=torch.float32)
    with precision.fast_matmul(keys.device):  # TF32 on CUDA (kvpress_prob.proposals.precision: its tolerance, tested)
        for lo in range(0, s, chunk_size):
            hi = min(s, lo + chunk_size)
            top = ends[hi - 1]  # rows lo..hi-1 see keys 0..top-1 at most (causal)
            q = queries[:, :, lo:hi].reshape(b, hkv, g * (hi - lo), d)  # query heads of a group stacked
            e = buffer[: b * hq * (hi - lo) * top].view(b, hkv, g * (hi - lo), top)
            e = torch.matmul(q, k[..., :top], out=e).view(b, hkv, g, hi - lo, top)  # (b, H_kv, g, c, top)
            first = ends[lo]  # every row of the chunk sees keys 0..first-1: only the keys after are masked
            e[..., first:top].masked_fill_(positions[None, first:top] > rows[lo:hi, None], float("-inf"))
            e.sub_(e.amax(dim=-1, keepdim=True)).exp_()  # softmax numerators, in place
            w = h[lo:hi] / e.sum(dim=-1)  # (b, H_kv, g, c): h_r / softmax denominator
            mass[..., :top] += torch.matmul(w[..., None, :], e)  # (b, H_kv, g, 1, top)
    return mass.view(b, hq, n)


def chunk_rows(keys: torch.Tensor, n_query_heads: int, n_layers: int, fraction: float | None = None) -> int:
    """Query rows per chunk such that one (b, H_q, rows, n) float32 buffer is at most ``fraction``
    of the model's full K+V (n_layers * 2 * b * H_kv * n * d * element size, from one layer's
    ``keys``): the rows do not depend on n, since both grow with it. Default 1/8 on CUDA (larger
    matmuls keep the device busy), 1/32 elsewhere."""
    fraction = fraction if fraction is not None else (1 / 8 if keys.is_cuda else 1 / 32)
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

    def mixture_rows(self, module, hidden_states, kwargs, n: int):
        """The query rows of the mixture: (queries (b, H_q, s, d), positions (s,), weights (s,))."""
        h, start = row_weights(n, self.rows, self.query_window, hidden_states.device)
        queries = rope_queries(module, hidden_states, kwargs["position_embeddings"])[:, :, start:]
        return queries, torch.arange(start, n, device=hidden_states.device), h

    def weights(self, module, hidden_states, keys, values, kwargs):
        b, hkv, n, d = keys.shape
        queries, rows, h = self.mixture_rows(module, hidden_states, kwargs, n)
        scaling = getattr(module, "scaling", 1.0 / math.sqrt(d))
        per_chunk = self.chunk_size or chunk_rows(keys, queries.shape[1], module.config.num_hidden_layers)
        mass = attention_mass(queries, rows, keys, h, scaling, per_chunk)  # (b, H_q, n)
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
    rows, computed in query chunks. ``centred=True`` uses ||v_i - o||.
    Geh et al., "A Probabilistic Interpretation of KV Cache Eviction" (2026).

    Parameters: those of ``AttentionProposal`` (harmonic, centred, query_window, chunk_size) and
    ``Proposal`` (floor, head_shared).
    """

    plain_rows: ClassVar[str] = "last"
    value_norm: ClassVar[bool] = True


@dataclass(kw_only=True)
class SampledMinVarianceProposal(MinVarianceProposal):
    """pi_min-h from ``query_rows`` sampled query rows instead of all of them: O(s n) per head, not O(n^2).

    The harmonic mixture sum_j h_j p_j(i) is estimated without bias by ``segment_rows``: the most
    recent rows (those heavier than an equal share of the rest) exactly, one row drawn with
    probability proportional to h_j from each of the other segments of equal harmonic mass, weighted
    by its segment's mass. The estimate then goes through pi_min-h's own steps (times ||v_i||,
    normalised per query head, mean over the group, floor), so the proposal is a consistent, not
    unbiased, estimate of pi_min-h; the press's correction stays unbiased whatever proposal it
    samples from. query_rows >= the number of rows gives
    ``MinVarianceProposal``'s proposal exactly. Beyond Geh et al. (2026), whose pi_min-h this estimates.

    Parameters
    ----------
    query_rows : int
        s >= 1: the number of query rows whose attention is computed (at most s; fewer when a
        segment is empty).
    row_seed : int, default 0
        Seed of the row draws. Layer l draws from a CPU generator seeded with (row_seed, l): the same
        row_seed gives the same rows, so the same proposal, for the same prefill, on any device.
        The press's ``seed`` (the entries' draws) is separate.
    harmonic : bool, default True
        As ``MinVarianceProposal``; with False (the last row only) there is nothing to sample.
    Other parameters: those of ``MinVarianceProposal`` (centred, query_window, chunk_size) and
    ``Proposal`` (floor, head_shared, sharpness).
    """

    harmonic: bool = True
    query_rows: int
    row_seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.query_rows < 1:
            raise ValueError(f"query_rows must be >= 1, got {self.query_rows}")

    def sample_rows(self, n: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s rows for a prefix of n: (positions (k,), weights (k,)), on the CPU."""
        h, start = row_weights(n, self.rows, self.query_window, "cpu")
        generator = torch.Generator().manual_seed(self.row_seed * 100_003 + int(layer_idx))
        rows, weights = segment_rows(h, self.query_rows, generator)
        return rows + start, weights

    def mixture_rows(self, module, hidden_states, kwargs, n: int):
        rows, weights = self.sample_rows(n, module.layer_idx)
        rows = rows.to(hidden_states.device)
        queries = rope_queries(module, hidden_states, kwargs["position_embeddings"], rows)  # only these rows
        return queries, rows, weights


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
