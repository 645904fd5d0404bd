"""Attention over a ``RaggedLayer``: the portable route, the choice of route, and the handler that answers a ragged
layer's forwards.

The model hands its attention function the tensors ``RaggedLayer.update`` returned: ``RaggedKeys``
placeholders carrying the layer's ``RaggedContext``. This module registers ``handle`` as the "ragged" handler of
``kvpress_prob.attention_dispatch`` (whose ``install()`` ``evict_ragged`` calls): a forward whose keys carry a context
runs the route ``choose`` gives (the "ragged" route of ``attention_dispatch.set_route``: by default the portable
route ``ragged_sdpa`` on a CPU, FlexAttention on CUDA; the fused routes are in ``kvpress_prob.cache.ragged_fused``),
and the handler answers nothing for any other. The model's attention mask is not read
there: a ragged cache holds one sequence without padding, and the route builds each head's own mask (its kept
entries all visible, the new tokens causal).

``ragged_sdpa`` serves decoding steps (q = 1) and forwards of several new tokens (a question). Query heads
h g ... h g + g - 1 (GQA: g query heads per KV head) attend to KV head h's region of the flat buffers, one
contiguous view ``[c_h kept entries | t appended tokens]`` (the forward's q new tokens last), with the kept
entries' bias where the layer stores one:

  out_i = sum_j softmax_j(q_i k_j * scaling + bias_j + causal_ij) v_j      (j over head h's c_h + t slots)

One ``scaled_dot_product_attention`` call per KV head, on 4-d views of the flat buffers (as the model's own SDPA
call, so the CPU's fused kernel runs it: a 3-d call falls back to the unfused math kernel, two to three times
slower): nothing of a layer's size is copied, and each call accumulates in float32 as the model's own SDPA does.
Several new tokens fold the g query heads into the query axis, with the mask repeated per head, in chunks of at
most 2 d query rows per call, so no transient exceeds the head's share of one padded layer (2 c_h d entries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpress_prob import attention_dispatch, flex_kernel
from kvpress_prob.cache import ragged_fused
from kvpress_prob.cache.layout import RaggedContext, RaggedKeys


def ragged_sdpa(query: torch.Tensor, context: RaggedContext, scaling: float | None = None) -> torch.Tensor:
    """Attention of ``query`` (1, H_q, q, d), the forward's q new tokens, over a ragged layer's ``context``
    (the new tokens already appended: the last q of its ``tail``). Returns (1, q, H_q, d), the layout
    transformers' attention functions return (see the module for the formula)."""
    H, g, q_len, d = ragged_fused.forward_shape(query, context)
    hq, t = H * g, context.tail
    if q_len == 1:  # one decoding step: the g query heads of KV head h are the rows of rows_of[:, h]
        rows_of, steps = query.view(1, H, g, d), []
    else:
        out = query.new_empty(1, q_len, hq, d)
        rows = torch.arange(q_len, device=query.device)[:, None]
        causal = torch.arange(t, device=query.device)[None, :] <= rows + (t - q_len)  # (q, t): new token i sees j
    for h, (start, kept) in enumerate(zip(context.starts, context.lengths)):
        span = slice(start, start + kept + t)
        keys, values = context.keys[span][None, None], context.values[span][None, None]  # (1, 1, c_h + t, d) views
        bias = None if context.bias is None else context.bias[start: start + kept].to(query.dtype)  # (c_h,)
        heads = slice(h * g, (h + 1) * g)
        if q_len == 1:
            mask = None if bias is None else F.pad(bias, (0, t))[None]  # (1, c_h + t), broadcast over the g rows
            steps.append(F.scaled_dot_product_attention(rows_of[:, h:h + 1], keys, values, attn_mask=mask,
                                                        scale=scaling))
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
            qh = query[0, heads, i:j].reshape(1, 1, g * (j - i), d)
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scaling)
            out[0, i:j, heads] = o[0, 0].view(g, j - i, d).transpose(0, 1)
    return torch.cat(steps, dim=1).view(1, 1, hq, d) if q_len == 1 else out


def auto_route(device: torch.device | str) -> str:
    """The route "auto" runs on ``device``: "flex" on CUDA where torch has FlexAttention, else "portable"."""
    return "flex" if torch.device(device).type == "cuda" and flex_kernel.available() else "portable"


def choose(query: torch.Tensor):
    """The function that runs a ragged forward of ``query`` on the route set (the "ragged" route of
    ``attention_dispatch.set_route``): one of ``ragged_sdpa``, ``ragged_fused.flex_ragged``,
    ``ragged_fused.nested_ragged``, ``ragged_fused.flash_ragged``, read when called.
    A route that cannot serve a forward (the nested route at q > 1 or with a bias, the flash route without CUDA
    and flash_attn, with a bias or in float32) raises, naming the routes that can."""
    name, routes = attention_dispatch.route("ragged"), attention_dispatch.ROUTES["ragged"]
    if name == "auto":
        name = auto_route(query.device)
    if name == "flash" and not (query.is_cuda and ragged_fused.flash_available()):
        raise RuntimeError(f"the flash route needs a CUDA device and the flash_attn package (query on "
                           f"{query.device}, flash_attn importable: {ragged_fused.flash_available()}); choose "
                           f"another of {routes}")
    if name == "flex" and not flex_kernel.available():
        raise RuntimeError(f"the flex route needs torch.nn.attention.flex_attention (torch {torch.__version__}); "
                           f"choose another of {routes}")
    return {"portable": ragged_sdpa, "flex": ragged_fused.flex_ragged, "nested": ragged_fused.nested_ragged,
            "flash": ragged_fused.flash_ragged}[name]


def handle(module, query, key, value, attention_mask, **kwargs):
    """The "ragged" handler of ``attention_dispatch``: a forward whose keys are a ragged layer's placeholders runs the
    route ``choose`` gives (no weights); any other is not this handler's (None)."""
    if not isinstance(key, RaggedKeys):
        return None
    return choose(query)(query, key.context, kwargs.get("scaling")), None


attention_dispatch.register("ragged", handle, priority=20)

__all__ = ["auto_route", "choose", "handle", "ragged_sdpa"]
