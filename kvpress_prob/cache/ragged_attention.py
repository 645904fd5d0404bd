"""Attention over a ``RaggedLayer``: the portable route, the choice of route, and the wrapper that routes a ragged
layer's forwards.

The model hands its attention function the tensors ``RaggedLayer.update`` returned: ``RaggedKeys``
placeholders carrying the layer's ``RaggedContext``. ``install()`` wraps every function of transformers'
``ALL_ATTENTION_FUNCTIONS`` (on top of kvpress's and the correction's wrappers, idempotent; called by
``evict_ragged``): a forward whose keys carry a context runs the route ``choose`` gives (``set_route``: by default
the portable route ``ragged_sdpa`` on a CPU, FlexAttention on CUDA; the fused routes are in
``kvpress_prob.cache.ragged_fused``), any other runs the function unchanged. The model's attention mask is not read
there: a ragged cache holds one sequence without padding, and the route builds each head's own mask (its kept
entries all visible, the new tokens causal).

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

from kvpress_prob.attention_dispatch import wrap_all
from kvpress_prob.cache import ragged_fused as fused
from kvpress_prob.cache.layout import RaggedContext, RaggedKeys
from kvpress_prob.correction import corrected_flex as flex

_WRAPPED = "_kvprob_ragged_wrapped"  # on a wrapper function: marks it as this module's


def ragged_sdpa(query: torch.Tensor, context: RaggedContext, scaling: float | None = None) -> torch.Tensor:
    """Attention of ``query`` (1, H_q, q, d), the forward's q new tokens, over a ragged layer's ``context``
    (the new tokens already appended: the last q of its ``tail``). Returns (1, q, H_q, d), the layout
    transformers' attention functions return (see the module for the formula)."""
    H, g, q_len, d = fused.forward_shape(query, context)
    hq, t = H * g, context.tail
    if q_len == 1:  # one decoding step: the g query heads of KV head h are the rows of rows_of[h]
        rows_of, steps = query.reshape(H, g, d), []
    else:
        out = query.new_empty(1, q_len, hq, d)
        rows = torch.arange(q_len, device=query.device)[:, None]
        causal = torch.arange(t, device=query.device)[None, :] <= rows + (t - q_len)  # (q, t): new token i sees j
    for h, (start, kept) in enumerate(zip(context.starts, context.lengths)):
        span = slice(start, start + kept + t)
        keys, values = context.keys[span][None], context.values[span][None]  # (1, c_h + t, d) views
        bias = None if context.bias is None else context.bias[start: start + kept].to(query.dtype)  # (c_h,)
        heads = slice(h * g, (h + 1) * g)
        if q_len == 1:
            mask = None if bias is None else F.pad(bias, (0, t))[None]  # (1, c_h + t)
            steps.append(F.scaled_dot_product_attention(rows_of[h:h + 1], keys, values, attn_mask=mask, scale=scaling))
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
    return torch.cat(steps).view(1, 1, hq, d) if q_len == 1 else out


ROUTES = ("auto", "portable", "flex", "nested", "flash")
_ROUTE = ["auto"]


def set_route(route: str) -> None:
    """The route every ragged layer's forward runs: "auto" (FlexAttention on CUDA where torch has it, the portable
    route elsewhere), "portable" (``ragged_sdpa``), "flex", "nested" or "flash" (``kvpress_prob.cache.ragged_fused``)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    _ROUTE[0] = route


def route() -> str:
    return _ROUTE[0]


def auto_route(device: torch.device | str) -> str:
    """The route "auto" runs on ``device``: "flex" on CUDA where torch has FlexAttention, else "portable"."""
    return "flex" if torch.device(device).type == "cuda" and flex.available() else "portable"


def choose(query: torch.Tensor):
    """The function that runs a ragged forward of ``query`` on the route set (``set_route``): one of
    ``ragged_sdpa``, ``fused.flex_ragged``, ``fused.nested_ragged``, ``fused.flash_ragged``, read when called.
    A route that cannot serve a forward (the nested route at q > 1 or with a bias, the flash route without CUDA
    and flash_attn, with a bias or in float32) raises, naming the routes that can."""
    name = _ROUTE[0]
    if name == "auto":
        name = auto_route(query.device)
    if name == "flash" and not (query.is_cuda and fused.flash_available()):
        raise RuntimeError(f"the flash route needs a CUDA device and the flash_attn package (query on "
                           f"{query.device}, flash_attn importable: {fused.flash_available()}); choose another of "
                           f"{ROUTES}")
    if name == "flex" and not flex.available():
        raise RuntimeError(f"the flex route needs torch.nn.attention.flex_attention (torch {torch.__version__}); "
                           f"choose another of {ROUTES}")
    return {"portable": ragged_sdpa, "flex": fused.flex_ragged, "nested": fused.nested_ragged,
            "flash": fused.flash_ragged}[name]


def wrap(func, name: str | None = None):
    """Wrap one attention function (registered as ``name``): a forward on a ragged layer runs the route ``choose``
    gives (idempotent)."""
    if getattr(func, _WRAPPED, False):
        return func

    @functools.wraps(func)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        if not isinstance(key, RaggedKeys):
            return func(module, query, key, value, attention_mask, *args, **kwargs)
        return choose(query)(query, key.context, kwargs.get("scaling")), None

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install() -> None:
    """Wrap every attention function transformers knows now (idempotent)."""
    wrap_all(_WRAPPED, wrap)


__all__ = ["ROUTES", "auto_route", "choose", "install", "ragged_sdpa", "route", "set_route", "wrap"]
