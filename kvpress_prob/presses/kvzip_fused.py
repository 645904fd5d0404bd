"""KVzip's reconstruction attention and its score from one set of logits.

KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025, arXiv
2505.23416) scores each context entry by the largest attention it receives from the reconstruction's queries,
the softmax taken over KVzip's subset of the cache: the sinks, the chunk being reconstructed and the
reconstruction tokens (causal among themselves), with the maximum over the query heads of each KV head's group
(kvpress's ``KVzipPress._compute_cross_attention``). The reconstruction forward computes the same logits to
attend over the whole cache. ``fused_attention`` computes both from them:

- the layer's attention output, softmax(q k / sqrt(d)) v over the whole cache [context | reconstruction tokens],
  causal among the reconstruction tokens, in blocks of ``ROWS`` query rows (each block's logits at most
  ``kvzip_scoring.ATTENTION_BYTES``, in one buffer reused by every block), each row's keys cut at its own causal
  end (no future token's logit computed), the query group folded into the rows (the keys of a KV head read once
  per block, never repeated per query head);
- each chunk entry's KVzip score, from the same normalised weights p: with S the subset,
  softmax_S(l)_j = p_j / sum_{k in S} p_k, and the score is its maximum over the rows and the group. A row whose
  mass on S is under ``float tiny / eps`` (where p's rounding would be relative to the whole cache, not S) gets
  the subset's softmax from its own logits, recomputed.

The queries are the forward's own (projected once, RoPE applied once). The computation runs in the queries'
dtype, in float32 for half-precision queries (the output and scores then cast back).

``active(press, modules)`` routes the forwards of ``modules`` (a press's reconstruction passes) to the press's
``fused_attention``; ``handler`` is the attention handler that does it (``None`` for any other forward).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager

import torch

from kvpress_prob import attention_dispatch

#: Query rows per block of the fused attention (fewer where a block's logits would exceed the bytes bound).
ROWS = 64

_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> press running its passes


@contextmanager
def active(press, modules):
    """Within: a forward of any of ``modules`` runs ``press.fused_attention`` (``handler``)."""
    for module in modules:
        _ACTIVE[module] = press
    try:
        yield
    finally:
        for module in modules:
            _ACTIVE.pop(module, None)


def handler(module, query, key, value, attention_mask, **kwargs):
    """The attention handler of KVzip's reconstruction forwards: ``(output, None)`` from the active press's
    ``fused_attention`` for a module within ``active``, None (not this handler's) for any other forward and for
    what it does not compute (a batch, a sliding window, soft-capping, attention sinks, dropout)."""
    press = _ACTIVE.get(module)
    if press is None or query.shape[0] != 1 or getattr(module, "sliding_window", None) \
            or kwargs.get("softcap") or kwargs.get("s_aux") is not None or kwargs.get("dropout", 0.0):
        return None
    scaling = kwargs.get("scaling")
    return press.fused_attention(module, query, key, value, module.scaling if scaling is None else scaling), None


#: Asked before the ragged (20) and corrected (10) handlers; it answers only the modules of a press ``active`` now.
PRIORITY = 30
attention_dispatch.register("kvzip_fused", handler, PRIORITY)


def rows_per_block(heads: int, width: int, element_size: int, bound: int) -> int:
    """Query rows per block: ``ROWS``, fewer where ``heads`` x rows x ``width`` logits exceed ``bound`` bytes
    (at least one)."""
    return max(1, min(ROWS, bound // max(1, heads * width * element_size)))


@torch.no_grad()
def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, sink: int,
                    start: int, end: int, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reconstruction's attention output and KVzip's scores of the chunk [start, end) (see the module).

    Parameters
    ----------
    query : (1, H_q, q, d), RoPE applied (the forward's).
    key, value : (1, H_kv, n + q, d), the cache [n context entries | the q reconstruction tokens].
    scaling : the logits' scale (1 / sqrt(d)).
    sink : the sinks, the first ``sink`` entries (at most ``start``).
    start, end : the chunk being reconstructed, 0 <= sink <= start < end <= n.
    bound : the most bytes of one block's logits.

    Returns
    -------
    output : (1, q, H_q, d) in the query's dtype (the layout transformers' attention functions return).
    scores : (1, H_kv, end - start), the largest softmax_S weight each chunk entry receives from any row and
        any query head of its KV head's group, in the query's dtype.
    """
    b, h_q, q_len, d = query.shape
    h_kv, total = key.shape[1], key.shape[2]
    n, groups = total - q_len, h_q // h_kv
    if not 0 <= sink <= start < end <= n:
        raise ValueError(f"the chunk [start, end) = [{start}, {end}) and sink = {sink} must satisfy 0 <= sink <= "
                         f"start < end <= n = {n} (the context entries before the {q_len} reconstruction tokens)")
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    # each row's query group adjacent, scaled once: (b, H_kv, q, G, d)
    queries = (query.to(dtype) * scaling).view(b, h_kv, groups, q_len, d).transpose(2, 3).contiguous()
    keys_t, values = key.to(dtype).transpose(-2, -1), value.to(dtype)
    rows = rows_per_block(h_q, total, torch.finfo(dtype).bits // 8, bound)
    buffer = queries.new_empty(b * h_kv * rows * groups * total)
    block_out = queries.new_empty(b, h_kv, rows * groups, d)
    output = query.new_empty(b, q_len, h_kv, groups, d)
    future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu(1)  # (row, key): key after row
    low = torch.finfo(dtype).tiny / torch.finfo(dtype).eps
    scores = None
    for first in range(0, q_len, rows):
        stop = min(q_len, first + rows)
        r, width = stop - first, n + stop  # row i sees the context and the reconstruction tokens up to i
        logits = buffer[: b * h_kv * r * groups * width].view(b, h_kv, r * groups, width)
        torch.matmul(queries[:, :, first:stop].reshape(b, h_kv, r * groups, d), keys_t[..., :width], out=logits)
        logits = logits.view(b, h_kv, r, groups, width)
        logits[..., n + first : width].masked_fill_(future[:r, None, :r], float("-inf"))
        if logits.device.type == "cpu":  # in place: p over the whole cache
            weights = torch.ops.aten._softmax.out(logits, -1, False, out=logits)
        else:
            weights = torch.softmax(logits, dim=-1)
        out = block_out[:, :, : r * groups]
        torch.matmul(weights.view(b, h_kv, r * groups, width), values[:, :, :width], out=out)
        output[:, first:stop] = out.view(b, h_kv, r, groups, d).permute(0, 2, 1, 3, 4).to(output.dtype)
        # KVzip's subset S: the sinks, the chunk, the reconstruction tokens
        chunk = weights[..., start:end]
        mass = weights[..., :sink].sum(-1) + chunk.sum(-1) + weights[..., n:].sum(-1)  # (b, H_kv, r, G)
        faint = mass < low
        block = chunk.mul_(mass.reciprocal()[..., None])  # softmax_S on the chunk, in place
        if bool(faint.any()):
            block[faint] = _subset_softmax(queries[:, :, first:stop], keys_t, faint, sink, start, end, n, first)
        block = block.amax(dim=(2, 3))  # (b, H_kv, end - start): the maximum over the rows and the group
        scores = block if scores is None else torch.maximum(scores, block)
    return output.view(b, q_len, h_q, d), scores.to(query.dtype)


def _subset_softmax(queries, keys_t, rows, sink, start, end, n, first):
    """softmax_S of the chunk entries for the (row, group) pairs ``rows`` (b, H_kv, r, G) of a block whose first row
    is the reconstruction's ``first``, from their own logits: (count, end - start)."""
    b, h_kv, r, groups, d = queries.shape
    q_len = keys_t.shape[-1] - n
    subset = torch.cat([keys_t[..., :sink], keys_t[..., start:end], keys_t[..., n:]], dim=-1)  # (b, H_kv, d, m)
    logits = torch.matmul(queries.reshape(b, h_kv, r * groups, d), subset).view(b, h_kv, r, groups, -1)
    row = torch.arange(first, first + r, device=logits.device)[:, None, None]
    logits[..., sink + end - start:].masked_fill_(torch.arange(q_len, device=logits.device) > row, float("-inf"))
    return torch.softmax(logits[rows], dim=-1)[:, sink : sink + end - start]


__all__ = ["ROWS", "active", "fused_attention", "handler", "rows_per_block"]
