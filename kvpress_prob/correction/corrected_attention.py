"""The attention functions the correction runs in: transformers' ``ALL_ATTENTION_FUNCTIONS``, wrapped.

Nothing is wrapped at import. ``install()`` wraps every entry present at the time it is called, on
top of whatever is there (kvpress's own wrapper, which AdaKV needs, included); a wrapped entry is
never wrapped twice. It is called when a SamplingPress is entered (``post_init_from_model``), when
a correction bias is given (``correction.set_bias``) and before every forward that reads one
(``correction``'s pre-hook), so an attention function registered after import, or after the
eviction, is corrected too.

At a prefill, a wrapped function first checks the kvpress wrappers hooked on the module
(``wrappers.check_hooks``: one holding a SamplingPress it cannot run is refused). It runs the
original unchanged unless the module's current forward carries a bias
(``activate``d by ``kvpress_prob.correction.bias``'s pre-hook for a cache compressed by a SamplingPress)
and is not a prefill; then it runs ``corrected`` (``corrected_sdpa`` on a CPU, FlexAttention on CUDA
and under flash attention: ``kvpress_prob.correction.corrected_flex``): softmax(q k / sqrt(d) + bias) over [stored
prefix | new tokens], the bias 0 on new tokens, which is

  out = [sum_kept w_i e^{s_i} v_i + sum_new e^{s_j} v_j] / [sum_kept w_i e^{s_i} + sum_new e^{s_j}]

(self-normalised importance sampling). It builds its own mask from the layer's real key length (transformers
builds the model's mask from layer 0's length, wrong here since layers differ): bias on the
stored prefix, causal among the new tokens.

A layer without a bias whose key length differs from layer 0's (a top-k cache stored as K and V only) runs
the original function, with the model's mask refitted to its length (``own_length_mask``) where a forward of
several new tokens needs one (a decoding step under sdpa or flash attention gets no mask at all).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob.attention_dispatch import wrap_all
from kvpress_prob.correction import corrected_flex as flex
from kvpress_prob.correction import wrappers

_WRAPPED = "_kvprob_wrapped"  # on a wrapper function: marks it as ours
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


def own_length_mask(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The model's 4-d mask (b or 1, 1, q, k0), built for layer 0's key length k0, refitted to this layer's k
    keys (b, H_kv, k, d): unchanged where it fits (or is not 4-d: flash attention's is None without padding).
    A compressed cache whose layers differ in length (a top-k press's, stored without a bias) needs it in a
    forward of several new tokens: the q new tokens are the last q keys of every layer, so their block (the
    mask's last q columns) is kept, and the k - q stored entries before them are all visible. A mask that
    hides a stored entry (padding in a batch) cannot be refitted, and raises."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[-1] == key.shape[2]:
        return attention_mask
    q_len, k_len = query.shape[2], key.shape[2]
    k0 = attention_mask.shape[-1]
    new = attention_mask[..., k0 - q_len:]  # (b, 1, q, q): the new tokens' block
    past = attention_mask[..., : k0 - q_len]
    visible = past if past.dtype == torch.bool else past == 0
    if not bool(visible.all()):
        raise ValueError(
            f"a layer holds {k_len} keys but the attention mask was built for {k0}, and it hides stored entries "
            f"(padding): a cache whose layers differ in length decodes with batch size 1 and no padding")
    fill = torch.ones((), dtype=torch.bool, device=new.device) if new.dtype == torch.bool else new.new_zeros(())
    return torch.cat([fill.expand(*new.shape[:-1], k_len - q_len), new], dim=-1)


def corrected(query, key, value, bias, scaling, implementation: str | None = None) -> torch.Tensor:
    """The corrected attention on its route: fused (FlexAttention, ``kvpress_prob.correction.corrected_flex``) on CUDA and
    under a flash-attention implementation, else ``corrected_sdpa``."""
    if flex.use_fused(query, implementation):
        return flex.flex_corrected(query, key, value, bias, scaling)
    return corrected_sdpa(query, key, value, bias, scaling)


def wrap(func, name: str | None = None):
    """Wrap one attention function (registered as ``name``) with the correction (idempotent)."""
    if getattr(func, _WRAPPED, False):
        return func

    @functools.wraps(func)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        bias = _ACTIVE.get(module)
        if query.shape[2] == key.shape[2]:  # a prefill: refuse a wrapper that cannot run a SamplingPress
            wrappers.check_hooks(module)
        if bias is None or query.shape[2] == key.shape[2]:  # plain attention, or a prefill
            return func(module, query, key, value, own_length_mask(attention_mask, query, key), *args, **kwargs)
        if query.shape[0] != bias.shape[0]:
            raise ValueError(
                f"batch size {query.shape[0]} differs from the batch size {bias.shape[0]} the cache was compressed with"
            )
        return corrected(query, key, value, bias, kwargs.get("scaling"), name), None

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install() -> None:
    """Wrap every attention function transformers knows now (idempotent)."""
    wrap_all(_WRAPPED, wrap)


def ensure_installed(implementation: str) -> None:
    """``install()`` unless the function registered as ``implementation`` is wrapped already: the one
    check a forward needs (a dictionary look-up, not a pass over every function, at every step)."""
    if not getattr(ALL_ATTENTION_FUNCTIONS[implementation], _WRAPPED, False):
        install()


def check_implementation(model) -> None:
    """Raise if ``model``'s attention implementation is not one of ``ALL_ATTENTION_FUNCTIONS`` (eager
    attention, whose function cannot be wrapped)."""
    implementation = model.config._attn_implementation
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"SamplingPress needs an attention implementation from ALL_ATTENTION_FUNCTIONS "
            f"{sorted(ALL_ATTENTION_FUNCTIONS.keys())}, got attn_implementation={implementation!r}: "
            f"load the model with attn_implementation='sdpa'"
        )
