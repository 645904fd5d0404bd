"""Decode-time correction: self-normalised importance sampling as an additive logit bias.

After eviction each layer of the compressed cache carries a bias of shape (b, H_kv, S): the
log-weight / tau of each stored prefix entry (S = the layer's largest kept count), and the dtype's
most negative finite value on padding. Every later forward on that cache goes through
``corrected_sdpa``: softmax(q k / sqrt(d) + bias) over [stored prefix | new tokens], the bias 0 on
new tokens, which is

  out = [sum_kept w_i e^{s_i} v_i + sum_new e^{s_j} v_j] / [sum_kept w_i e^{s_i} + sum_new e^{s_j}]

(docs/method.md, "Correction"). It builds its own mask from the layer's real key length (transformers
builds the model's mask from layer 0's length, wrong here since layers differ): bias on the
stored prefix, causal among the new tokens.

Lifetime: the bias belongs to the one compressed cache, and lives on its layer objects (it is
freed with the cache, copied with ``copy.deepcopy``, and never seen by another cache). A forward
pre-hook, registered once on every attention module that was given a bias, runs before each of its
forwards under any attention implementation (eager included) and hands the attention function the
bias of that forward's own cache layer, or none. So nothing a press leaves behind reaches a later
prefill, another press, a plain forward or ``model.generate``, while the kvpress pipeline, which
decodes after the press's ``with`` block, decodes its compressed cache with the correction, and
two compressed caches can be decoded in any interleaving. A layer emptied and prefilled again in
the same cache object loses its bias. Decoding a biased cache on eager attention, whose function
is not wrapped, raises instead of silently skipping the correction.

``install()`` wraps every entry of transformers' ``ALL_ATTENTION_FUNCTIONS`` once (on top of
kvpress's own wrapper, which AdaKV needs); forwards without a bias go straight to the wrapped
function. The state is read and written only through ``set_bias``, ``bias_of`` and ``reset``.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# attributes, read and written only by the functions of this module
_BIAS = "_kvprob_bias"  # on a cache layer: its (b, H_kv, S) bias
_CURRENT = "_kvprob_cache"  # on an attention module: weakref to the cache it last ran on or was given
_PENDING = "_kvprob_pending"  # on an attention module: a bias given without a cache, for its next decoding forward
_ACTIVE = "_kvprob_active"  # on an attention module: the bias of the forward now running
_HOOKS = "_kvprob_hooks"  # on an attention module: its pre- and post-hook handles (registered once)


def _layer(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    return layers[layer_idx] if layers is not None and layer_idx < len(layers) else None


def _current_cache(module):
    ref = getattr(module, _CURRENT, None)
    return ref() if ref is not None else None


def set_bias(module: torch.nn.Module, bias: torch.Tensor | None, cache=None) -> None:
    """Give layer ``module.layer_idx`` of ``cache`` the bias (b, H_kv, S) of its S stored prefix
    entries (None: ``reset``). Without a cache, the bias goes to the cache of the module's next
    forward that is not a prefill."""
    if bias is None:
        reset(module)
        return
    if getattr(module, _HOOKS, None) is None:
        setattr(module, _HOOKS, (
            module.register_forward_pre_hook(_before_forward, with_kwargs=True),
            module.register_forward_hook(_after_forward, always_call=True),
        ))
    if cache is None:
        setattr(module, _PENDING, bias)
        return
    layer = _layer(cache, module.layer_idx)
    if layer is None:
        raise ValueError(f"the cache has no layer {module.layer_idx} to hold the correction of that layer")
    setattr(layer, _BIAS, bias)
    setattr(module, _CURRENT, weakref.ref(cache))
    setattr(module, _PENDING, None)


def bias_of(module: torch.nn.Module, cache=None) -> torch.Tensor | None:
    """The bias of this module's layer of ``cache`` (default: the cache the module last ran on or
    was given by ``set_bias``; then also a bias given without a cache). None: plain attention."""
    if cache is None:
        pending = getattr(module, _PENDING, None)
        if pending is not None:
            return pending
        cache = _current_cache(module)
    return getattr(_layer(cache, module.layer_idx), _BIAS, None)


def reset(module: torch.nn.Module) -> None:
    """Drop the correction of this module's layer of the cache it last ran on or was given (that
    cache then decodes with plain attention), and any bias given without a cache."""
    layer = _layer(_current_cache(module), module.layer_idx)
    if layer is not None and hasattr(layer, _BIAS):
        delattr(layer, _BIAS)
    setattr(module, _PENDING, None)


def _before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the bias for this forward is the one of its own cache layer, if any."""
    setattr(module, _ACTIVE, None)
    cache = kwargs.get("past_key_values")
    layer = _layer(cache, module.layer_idx)
    if cache is not None:
        setattr(module, _CURRENT, weakref.ref(cache))
    stored = layer.get_seq_length() if layer is not None else 0
    pending = getattr(module, _PENDING, None)
    if pending is not None:
        setattr(module, _PENDING, None)
        if stored > 0:
            setattr(layer, _BIAS, pending)
    bias = getattr(layer, _BIAS, None)
    if bias is None:
        return None
    if stored == 0:  # the layer was emptied and is prefilled again: its old correction is void
        delattr(layer, _BIAS)
        return None
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise RuntimeError(
            f"layer {module.layer_idx} decodes a cache compressed by a SamplingPress, whose correction runs in "
            f"the attention functions of ALL_ATTENTION_FUNCTIONS, but attn_implementation={implementation!r}: "
            f"call model.set_attn_implementation('sdpa') before decoding"
        )
    setattr(module, _ACTIVE, bias)
    return None


def _after_forward(module: torch.nn.Module, args: tuple, output) -> None:
    setattr(module, _ACTIVE, None)
    return None


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
    dtype = torch.promote_types(query.dtype, bias.dtype)  # a float32 bias is added in float32
    lowest = torch.finfo(dtype).min
    new_mask = torch.zeros(q_len, n_new, dtype=dtype, device=query.device)
    new_mask.masked_fill_(j > i + (n_new - q_len), lowest)  # (q, n_new)
    mask = torch.cat(
        [bias.to(dtype)[:, :, None, :].expand(b, hkv, q_len, n_stored), new_mask.expand(b, hkv, q_len, n_new)],
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
        bias = getattr(module, _ACTIVE, None)  # set for this forward by _before_forward
        if bias is None or query.shape[2] == key.shape[2]:  # plain attention, or a prefill
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
