"""Fused attention routes over a ``RaggedLayer``: one call per layer over all heads, on the layer's flat buffers.

Each route computes what the portable route (``kvpress_prob.cache.ragged_attention.ragged_sdpa``) computes: query
head h g + i (GQA: g query heads per KV head) attends to KV head h's region of the flat buffers,
``[c_h kept entries | t appended tokens]``, the forward's q new tokens last and causal among them, with the kept
entries' bias where the layer stores one. They read the regions in place (the free slots after each region,
left for later tokens, are skipped), so nothing of the layer's size is copied.

- ``flex_ragged``: FlexAttention over the flat buffer as one key sequence of M slots shared by every query head
  (``enable_gqa`` with one KV head). A block mask lists, per query head and block of 128 queries, the blocks of
  128 slots its region spans; its ``mask_mod`` cuts each region's ends and the causal part, and a ``score_mod``
  adds the bias in float32 (float64 for a float64 query). Every forward: q = 1 or q > 1, with or without a bias,
  any dtype. Through ``kvpress_prob.flex_kernel.run``: compiled on CUDA (``dynamic=True``: M and q vary), eager on a
  CPU (an unfused computation of the same formula over every slot, in float32 as the CPU's SDPA accumulates,
  used by the tests; a copy of the layer, so not a route to decode with on a CPU).
- ``nested_ragged``: ``scaled_dot_product_attention`` on nested jagged tensors (``torch.nested``,
  ``layout=torch.jagged``), one component per KV head and one, without queries, per run of free slots (a
  jagged tensor's components are contiguous). SDPA takes no mask and no causal flag with jagged keys of
  another length than the queries, so this route serves decoding steps (q = 1) of a layer without a bias.
  On a CPU SDPA runs it through its math kernel on a strided copy (here in float32): a route for the tests.
- ``flash_ragged``: ``flash_attn_varlen_func`` (the ``flash_attn`` package, CUDA, fp16 / bf16), AdaKV's layout:
  the flat buffer with ``cu_seqlens`` per KV head (one sequence per region, one without queries per run of free
  slots), the g query heads of a KV head as the heads of its sequence, ``causal=True`` (flash-attn aligns it to
  the sequence's end, which makes the kept entries visible and the new tokens causal). No bias.

``varlen_layout`` builds the sequence boundaries the last two share.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvpress_prob import flex_kernel
from kvpress_prob.cache.layout import RaggedContext

BLOCK = 128  # FlexAttention's default block of queries and of key slots


def forward_shape(query: torch.Tensor, context: RaggedContext) -> tuple[int, int, int, int]:
    """(H, g, q, d) of a forward of ``query`` (1, H_q, q, d) over ``context``, after the checks every route makes
    (the portable route's too)."""
    b, hq, q_len, d = query.shape
    H = len(context.lengths)
    if b != 1:
        raise ValueError(f"a RaggedLayer holds one sequence: the query must have batch size 1, got {b}")
    if hq % H:
        raise ValueError(f"{hq} query heads do not group over {H} KV heads")
    if context.tail < q_len:
        raise RuntimeError(f"the ragged layer holds {context.tail} appended tokens, fewer than the {q_len} new "
                           "queries: was the layer changed outside its update()?")
    return H, hq // H, q_len, d


# ---- FlexAttention


def block_mask(context: RaggedContext, hq: int, q_len: int, device):
    """The ``BlockMask`` of a forward of ``q_len`` new tokens by ``hq`` query heads over ``context``'s flat buffer.

    Query i of head h g + j sees slots s_h ... s_h + c_h + t - q + i (s_h the region's start). Its blocks of
    BLOCK slots: from s_h // BLOCK to the block of the last slot its block of queries sees; the ``mask_mod``
    cuts the partial blocks at both ends."""
    from torch.nn.attention.flex_attention import BlockMask

    H, M = len(context.lengths), context.keys.shape[0]
    g = hq // H
    starts = torch.tensor(context.starts, device=device)  # (H,)
    last = starts + torch.tensor(context.lengths, device=device) + (context.tail - q_len)  # (H,): query 0's last slot
    q_blocks = -(-q_len // BLOCK)
    rows = torch.clamp(torch.arange(1, q_blocks + 1, device=device) * BLOCK, max=q_len) - 1  # (Qb,) last row of each
    first_block = starts // BLOCK  # (H,)
    last_block = (last[:, None] + rows[None, :]) // BLOCK  # (H, Qb)
    count = last_block - first_block[:, None] + 1  # (H, Qb)
    n_blocks = -(-M // BLOCK)  # the lists are n_blocks wide, as FlexAttention's own; entries past count are unread
    indices = torch.clamp(first_block[:, None, None] + torch.arange(n_blocks, device=device), max=n_blocks - 1)
    indices = indices.expand(H, q_blocks, n_blocks)
    per_head = lambda t: t.repeat_interleave(g, dim=0)[None].to(torch.int32).contiguous()  # noqa: E731  (1, H_q, ...)

    def mask_mod(b, h, qi, ki):
        kv = h // g
        return (ki >= starts[kv]) & (ki <= last[kv] + qi)

    return BlockMask.from_kv_blocks(per_head(count), per_head(indices), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(q_len, M), compute_q_blocks=False)


def flex_ragged(query: torch.Tensor, context: RaggedContext, scaling: float | None = None) -> torch.Tensor:
    """Attention of ``query`` (1, H_q, q, d) over ``context`` through FlexAttention (see the module). Returns
    (1, q, H_q, d)."""
    _, g, q_len, _ = forward_shape(query, context)
    keys, values = context.keys[None, None], context.values[None, None]  # (1, 1, M, d) views
    mask = block_mask(context, query.shape[1], q_len, query.device)
    score_mod = None
    if context.bias is not None:
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        bias = context.bias.to(work)  # (M,): 0 on appended tokens and free slots

        def score_mod(score, b, h, qi, ki):
            return score + bias[ki]

    out = flex_kernel.run(query, keys, values, score_mod=score_mod, block_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)  # (1, q, H_q, d)


# ---- the varlen layout: nested jagged tensors and flash-attn


def varlen_layout(context: RaggedContext, rows: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The flat buffer of M slots as 2 H contiguous sequences: region h's c_h + t used slots (sequence 2 h, with
    ``rows`` queries), then its free slots (sequence 2 h + 1, no queries). Returns the key offsets (2 H + 1,) and
    query offsets (2 H + 1,) (int32, from 0 to M and to H rows) and the longest key sequence."""
    used = [c + context.tail for c in context.lengths]
    ends = list(context.starts[1:]) + [context.keys.shape[0]]
    keys = [0]
    for start, u, end in zip(context.starts, used, ends):
        keys += [start + u, end]
    queries = [rows * (i // 2) for i in range(2, 2 * len(used) + 2)]
    return (torch.tensor(keys, dtype=torch.int32, device=device),
            torch.tensor([0] + queries, dtype=torch.int32, device=device), max(b - a for a, b in zip(keys, keys[1:])))


def nested_ragged(query: torch.Tensor, context: RaggedContext, scaling: float | None = None) -> torch.Tensor:
    """One decoding step of ``query`` (1, H_q, 1, d) over ``context`` (no bias) through SDPA on nested jagged
    tensors (see the module). Returns (1, 1, H_q, d)."""
    H, g, q_len, d = forward_shape(query, context)
    if q_len != 1 or context.bias is not None:
        raise ValueError(f"the nested route serves decoding steps (q = 1) of a layer without a bias (SDPA takes no "
                         f"mask with jagged keys), got q = {q_len} and a bias: {context.bias is not None}; choose the "
                         "'flex' or 'portable' route")
    key_offsets, query_offsets, _ = varlen_layout(context, g, query.device)  # the g query heads as g rows
    # on a CPU, SDPA runs jagged tensors through its math kernel on a strided copy: in float32 there, as the CPU's
    # dense SDPA accumulates (in a half dtype it would round the weights before P V)
    work = query.dtype if query.is_cuda or query.dtype == torch.float64 else torch.float32
    jagged = lambda x, offsets: torch.nested.nested_tensor_from_jagged(x.to(work), offsets.long()).transpose(1, 2)  # noqa: E731
    q = jagged(query.reshape(H * g, 1, d), query_offsets)  # (2 H, 1, j, d): the g heads of KV head h as its queries
    keys, values = jagged(context.keys[:, None], key_offsets), jagged(context.values[:, None], key_offsets)
    out = F.scaled_dot_product_attention(q, keys, values, scale=scaling)  # (2 H, 1, j, d)
    return out.transpose(1, 2).values().view(1, 1, H * g, d).to(query.dtype)


@functools.cache
def flash_available() -> bool:
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return False
    return True


def flash_ragged(query: torch.Tensor, context: RaggedContext, scaling: float | None = None) -> torch.Tensor:
    """Attention of ``query`` (1, H_q, q, d) over ``context`` (no bias; fp16 or bf16) through flash_attn's
    ``flash_attn_varlen_func`` (see the module; it runs on CUDA: ``ragged_attention.choose`` checks). Returns
    (1, q, H_q, d)."""
    H, g, q_len, d = forward_shape(query, context)
    if context.bias is not None or query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the flash route serves a layer without a bias in float16 or bfloat16, got a bias: "
                         f"{context.bias is not None}, dtype {query.dtype}; choose the 'flex' route")
    from flash_attn import flash_attn_varlen_func

    key_offsets, query_offsets, longest = varlen_layout(context, q_len, query.device)
    q = query[0].reshape(H, g, q_len, d).transpose(1, 2).reshape(H * q_len, g, d)  # sequence h: (q, g heads, d)
    out = flash_attn_varlen_func(q, context.keys[:, None], context.values[:, None], query_offsets, key_offsets,
                                 q_len, longest, softmax_scale=scaling, causal=True)  # (H q, g, d)
    return out.view(H, q_len, g, d).permute(1, 0, 2, 3).reshape(1, q_len, H * g, d)


__all__ = ["block_mask", "flash_available", "flash_ragged", "flex_ragged", "forward_shape", "nested_ragged",
           "varlen_layout"]
