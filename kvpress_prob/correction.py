"""Decode-time correction: self-normalised importance sampling as an additive logit bias.

After eviction each attention module holds ``module.kvprob_bias`` of shape (b, H_kv, S): the
log-weight / tau of each stored prefix entry (S = the layer's largest kept count), and the dtype's
most negative finite value on padding. Every later forward of that module goes through
``corrected_attention``: softmax(q k / sqrt(d) + bias) over [stored prefix | new tokens], the bias
0 on new tokens, which is

  out = [sum_kept w_i e^{s_i} v_i + sum_new e^{s_j} v_j] / [sum_kept w_i e^{s_i} + sum_new e^{s_j}]

(docs/method.md, "Correction"). It builds its own mask from the layer's real key length (transformers
builds the model's mask from layer 0's length, wrong here since layers differ): bias on the
stored prefix, causal among the new tokens. A prefill (query length == key length) clears the
state, the way kvpress clears ``masked_key_indices``.

``install()`` wraps every entry of transformers' ``ALL_ATTENTION_FUNCTIONS`` once (on top of
kvpress's own wrapper, which AdaKV needs); modules without a bias go straight to the wrapped
function. Eager attention is not in that table: the presses refuse it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_BIAS = "_kvprob_bias"  # module attribute; read and written only through the functions below


def reset(module: torch.nn.Module) -> None:
    """Forget the correction of one attention module."""
    setattr(module, _BIAS, None)


def set_bias(module: torch.nn.Module, bias: torch.Tensor | None) -> None:
    """Install ``bias`` (b, H_kv, S): the additive logit bias of the S stored prefix entries of
    this module's cache layer (None: plain attention)."""
    setattr(module, _BIAS, bias)


def bias_of(module: torch.nn.Module) -> torch.Tensor | None:
    """The bias installed on this module (None: plain attention)."""
    return getattr(module, _BIAS, None)


def corrected_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention with a per-entry bias on the stored prefix and a causal mask among new tokens.

    query (b, H_q, q, d); key, value (b, H_kv, k, d) = [S stored prefix entries | k - S new];
    bias (b, H_kv, S). Returns (b, q, H_q, d), the layout transformers' attention functions return.
    """
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = hq // hkv
    n_stored = bias.shape[-1]
    n_new = k_len - n_stored
    if n_new < q_len:
        raise RuntimeError(
            f"corrected attention expects the {q_len} new tokens after the {n_stored} stored ones, "
            f"got {k_len} keys: was the cache changed outside the press?"
        )
    # causal among new tokens: query i sits at new-token index n_new - q_len + i
    i = torch.arange(q_len, device=query.device)[:, None]
    j = torch.arange(n_new, device=query.device)[None, :]
    lowest = torch.finfo(query.dtype).min
    new_mask = torch.zeros(q_len, n_new, dtype=query.dtype, device=query.device)
    new_mask.masked_fill_(j > i + (n_new - q_len), lowest)  # (q, n_new)
    mask = torch.cat(
        [bias.to(query.dtype)[:, :, None, :].expand(b, hkv, q_len, n_stored), new_mask.expand(b, hkv, q_len, n_new)],
        dim=-1,
    )  # (b, H_kv, q, k)
    # fold the query heads of a group into the query axis: head h*g + gi serves KV head h
    q = query.reshape(b, hkv, g * q_len, d)
    mask = mask[:, :, None].expand(b, hkv, g, q_len, k_len).reshape(b, hkv, g * q_len, k_len)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # (b, H_kv, g*q, d)
    return out.view(b, hq, q_len, d).transpose(1, 2).contiguous()


def wrap(func):
    """Wrap one attention function with the correction (idempotent)."""
    if getattr(func, "_kvprob_wrapped", False):
        return func

    @functools.wraps(func)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        bias = getattr(module, _BIAS, None)
        if bias is None:
            return func(module, query, key, value, attention_mask, *args, **kwargs)
        if query.shape[2] == key.shape[2]:  # a new prefill: the correction belongs to the old cache
            reset(module)
            return func(module, query, key, value, attention_mask, *args, **kwargs)
        if query.shape[0] != bias.shape[0]:
            raise ValueError(
                f"batch size {query.shape[0]} differs from the batch size {bias.shape[0]} the cache was compressed with"
            )
        return corrected_sdpa(query, key, value, bias, kwargs.get("scaling")), None

    wrapper._kvprob_wrapped = True
    return wrapper


def install() -> None:
    """Wrap every attention function transformers knows (kvpress's wrappers included)."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        ALL_ATTENTION_FUNCTIONS[name] = wrap(ALL_ATTENTION_FUNCTIONS[name])
