"""Attention over a ``RaggedLayer``: the portable route, and the wrapper that routes a ragged layer's forwards to it.

The model hands its attention function the tensors ``RaggedLayer.update`` returned: ``RaggedKeys``
placeholders carrying the layer's ``RaggedContext``. ``install()`` wraps every function of transformers'
``ALL_ATTENTION_FUNCTIONS`` (on top of kvpress's and the correction's wrappers, idempotent; called by
``evict_ragged``): a forward whose keys carry a context runs ``ragged_sdpa``, any other runs the function
unchanged. The model's attention mask is not read there: a ragged cache holds one sequence without padding,
and the route builds each head's own mask (its kept entries all visible, the new tokens causal).

``ragged_sdpa`` serves decoding steps (q = 1) and forwards of several new tokens (a question). Query heads
h g ... h g + g - 1 (GQA: g query heads per KV head) attend to KV head h's region of the flat buffers, one
contiguous view ``[c_h kept entries | t appended tokens]`` (the forward's q new tokens last), with the kept
entries' bias where the layer stores one:

  out_i = sum_j softmax_j(q_i k_j * scaling + bias_j + causal_ij) v_j      (j over head h's c_h + t slots)

One ``scaled_dot_product_attention`` call per KV head, on views of the flat buffers: nothing of a layer's size
is copied, and each call accumulates in float32 as the model's own SDPA does. Several new tokens fold the g
query heads into the query axis, with the mask repeated per head, in chunks of at most 2 d query rows per
call, so no transient exceeds the head's share of one padded layer (2 c_h d entries).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob.cache.layout import RaggedContext, RaggedKeys

_WRAPPED = "_kvprob_ragged_wrapped"  # on a wrapper function: marks it as this module's


def ragged_sdpa(query: torch.Tensor, context: RaggedContext, scaling: float | None = None) -> torch.Tensor:
    """Attention of ``query`` (1, H_q, q, d), the forward's q new tokens, over a ragged layer's ``context``
    (the new tokens already appended: the last q of its ``tail``). Returns (1, q, H_q, d), the layout
    transformers' attention functions return (see the module for the formula)."""
    b, hq, q_len, d = query.shape
    H = len(context.lengths)
    if b != 1:
        raise ValueError(f"a RaggedLayer holds one sequence: the query must have batch size 1, got {b}")
    if hq % H:
        raise ValueError(f"{hq} query heads do not group over {H} KV heads")
    if context.tail < q_len:
        raise RuntimeError(f"the ragged layer holds {context.tail} appended tokens, fewer than the {q_len} new "
                           "queries: was the layer changed outside its update()?")
    g, t = hq // H, context.tail
    out = query.new_empty(1, q_len, hq, d)
    if q_len > 1:
        rows = torch.arange(q_len, device=query.device)[:, None]
        causal = torch.arange(t, device=query.device)[None, :] <= rows + (t - q_len)  # (q, t): new token i sees j
    for h, (start, kept) in enumerate(zip(context.starts, context.lengths)):
        span = slice(start, start + kept + t)
        keys, values = context.keys[span][None], context.values[span][None]  # (1, c_h + t, d) views
        bias = None if context.bias is None else context.bias[start: start + kept].to(query.dtype)  # (c_h,)
        heads = slice(h * g, (h + 1) * g)
        if q_len == 1:
            mask = None if bias is None else F.pad(bias, (0, t))[None]  # (1, c_h + t)
            o = F.scaled_dot_product_attention(query[0, heads, 0][None], keys, values, attn_mask=mask, scale=scaling)
            out[0, 0, heads] = o[0]
            continue
        step = max(1, 2 * d // g)  # query rows per call: g * step <= 2 d rows against c_h + t keys
        for i in range(0, q_len, step):
            j = min(q_len, i + step)
            visible = torch.cat([causal.new_ones(j - i, kept), causal[i:j]], dim=-1)  # (j - i, c_h + t)
            if bias is None:
                mask = visible
            else:
                mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
                mask[:, :kept] = bias
                mask.masked_fill_(~visible, torch.finfo(query.dtype).min)
            mask = mask[None].expand(g, -1, -1).reshape(g * (j - i), kept + t)
            qh = query[0, heads, i:j].reshape(1, g * (j - i), d)
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scaling)
            out[0, i:j, heads] = o[0].view(g, j - i, d).transpose(0, 1)
    return out


def wrap(func):
    """Wrap one attention function: a forward on a ragged layer runs ``ragged_sdpa`` (idempotent)."""
    if getattr(func, _WRAPPED, False):
        return func

    @functools.wraps(func)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        if not isinstance(key, RaggedKeys):
            return func(module, query, key, value, attention_mask, *args, **kwargs)
        return ragged_sdpa(query, key.context, kwargs.get("scaling")), None

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install() -> None:
    """Wrap every attention function transformers knows now (idempotent)."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        func = ALL_ATTENTION_FUNCTIONS[name]
        if not getattr(func, _WRAPPED, False):
            ALL_ATTENTION_FUNCTIONS[name] = wrap(func)


__all__ = ["install", "ragged_sdpa", "wrap"]
