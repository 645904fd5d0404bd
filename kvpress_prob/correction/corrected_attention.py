"""The corrected attention: what a forward on a cache compressed by a SamplingPress computes, and the handler that
runs it inside the attention functions (``kvpress_prob.attention_dispatch``, registered as "corrected" at import).

At a prefill, the handler checks the kvpress wrappers hooked on the module (``wrappers.check_hooks``: one holding a
SamplingPress it cannot run is refused) and answers nothing. It answers a forward that is not a prefill when the
module's current forward carries a bias (``activate``d by ``kvpress_prob.correction.bias``'s pre-hook for a cache
compressed by a SamplingPress) with ``corrected`` (``corrected_sdpa`` on a CPU, FlexAttention on CUDA and under flash
attention: ``kvpress_prob.correction.corrected_flex``; the "corrected" route of ``attention_dispatch.set_route``):
softmax(q k / sqrt(d) + bias) over [stored prefix | new tokens], the bias 0 on new tokens, which is

  out = [sum_kept w_i e^{s_i} v_i + sum_new e^{s_j} v_j] / [sum_kept w_i e^{s_i} + sum_new e^{s_j}]

(self-normalised importance sampling). It builds its own mask from the layer's real key length (transformers
builds the model's mask from layer 0's length, wrong here since layers differ): bias on the stored prefix, causal
among the new tokens. Every other forward runs the model's function (``attention_dispatch``: the mask refitted to
the layer's length where a forward of several new tokens needs one).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kvpress_prob import attention_dispatch
from kvpress_prob.correction import corrected_flex, wrappers

_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> bias of its running forward


def activate(module: torch.nn.Module, bias: torch.Tensor | None) -> None:
    """Give the forward of ``module`` about to run the bias (b, H_kv, S) of its cache layer (None: none)."""
    if bias is None:
        _ACTIVE.pop(module, None)
    else:
        _ACTIVE[module] = bias


def active_bias(module: torch.nn.Module) -> torch.Tensor | None:
    """The bias of the forward of ``module`` now running, or None."""
    return _ACTIVE.get(module)


def corrected_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention with a per-entry bias on the stored prefix and a causal mask among new tokens.

    query (b, H_q, q, d); key, value (b, H_kv, k, d) = [S stored prefix entries | k - S new];
    bias (b, H_kv, S). Returns (b, q, H_q, d) in the query's dtype, the layout transformers'
    attention functions return. The SDPA route: the reference, and the route on a CPU.
    """
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = hq // hkv
    n_stored = bias.shape[-1]
    n_new = k_len - n_stored
    out_dtype = query.dtype
    if n_new < q_len:
        raise RuntimeError(
            f"corrected attention expects the {q_len} new tokens after the {n_stored} stored ones, "
            f"got {k_len} keys: was the cache changed outside the press?"
        )
    # The mask has the dtype the attention computes in, which is the query's: CUDA's memory-efficient
    # kernel refuses a mask of another dtype. A bias wider than the query (float32 beside
    # bfloat16 / float16) is not rounded to the query's dtype: q, k and v are upcast to the bias's
    # dtype and the output cast back, so the bias is added in float32 as bias_dtype="float32" promises
    # (tests/test_mask_dtype.py: against float64, where a bfloat16-rounded bias is measurably worse).
    # On CUDA the fused route (``kvpress_prob.correction.corrected_flex``) adds it in float32 without any upcast copy.
    dtype = torch.promote_types(query.dtype, bias.dtype)
    if dtype != query.dtype:
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    lowest = torch.finfo(dtype).min
    # the bias in the compute dtype, padding that dtype's lowest (no copy when the dtypes agree: then
    # the padding already is the lowest value)
    stored = bias if bias.dtype == dtype else torch.where(bias == torch.finfo(bias.dtype).min, lowest, bias.to(dtype))
    if q_len == 1:
        # One decoding step: the query sees every entry, so the mask is one row per KV head, the bias
        # then 0 on the new tokens, broadcast over the g query heads of the group (folded into the
        # query axis). No causal part, no (g, q, k) copy: a pad of the bias is the only new tensor.
        mask = F.pad(stored, (0, n_new))[:, :, None, :]  # (b, H_kv, 1, k)
        out = F.scaled_dot_product_attention(query.reshape(b, hkv, g, d), key, value, attn_mask=mask, scale=scaling)
        return out.to(out_dtype).view(b, hq, 1, d).transpose(1, 2).contiguous()
    # several new tokens: causal among them; query i sits at new-token index n_new - q_len + i. The mask
    # (b, H_kv, g, q, k) is filled in place (one allocation) and viewed with g folded into the query axis:
    # head h*g + gi serves KV head h
    i = torch.arange(q_len, device=query.device)[:, None]
    j = torch.arange(n_new, device=query.device)[None, :]
    mask = torch.empty(b, hkv, g, q_len, k_len, dtype=dtype, device=query.device)
    mask[..., :n_stored] = stored[:, :, None, None, :]
    mask[..., n_stored:] = torch.zeros(q_len, n_new, dtype=dtype, device=query.device).masked_fill_(
        j > i + (n_new - q_len), lowest)  # (q, n_new)
    q = query.reshape(b, hkv, g * q_len, d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask.view(b, hkv, g * q_len, k_len), scale=scaling)
    out = out.to(out_dtype)
    return out.view(b, hq, q_len, d).transpose(1, 2).contiguous()


def corrected(query, key, value, bias, scaling, implementation: str | None = None) -> torch.Tensor:
    """The corrected attention on its route (``attention_dispatch.set_route(corrected=...)``): fused (FlexAttention,
    ``kvpress_prob.correction.corrected_flex``) on CUDA and under a flash-attention implementation, else
    ``corrected_sdpa``."""
    if corrected_flex.use_fused(query, implementation):
        return corrected_flex.flex_corrected(query, key, value, bias, scaling)
    return corrected_sdpa(query, key, value, bias, scaling)


def handle(module, query, key, value, attention_mask, **kwargs):
    """The "corrected" handler of ``attention_dispatch`` (see the module): None at a prefill (after refusing a
    wrapper that cannot run a SamplingPress) and where the module's forward carries no bias, else the corrected
    attention and no weights."""
    if query.shape[2] == key.shape[2]:
        wrappers.check_hooks(module)
        return None
    bias = _ACTIVE.get(module)
    if bias is None:
        return None
    if query.shape[0] != bias.shape[0]:
        raise ValueError(
            f"batch size {query.shape[0]} differs from the batch size {bias.shape[0]} the cache was compressed with"
        )
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return corrected(query, key, value, bias, kwargs.get("scaling"), implementation), None


attention_dispatch.register("corrected", handle, priority=10)

__all__ = ["activate", "active_bias", "corrected", "corrected_sdpa", "handle"]
