"""A float64 dense reference of a compressed cache: explicit attention on a float64 copy of the model.

``dense_reference`` gives the logits a model would produce if its cache held exactly a kept set of each layer's
prefix, computed the slow way: a full float64 prefill, then the new tokens on the attention function ``dense64``
(registered with transformers' ``AttentionInterface`` on import), which writes the softmax weights out and gives
the evicted entries none. It uses torch and transformers only, none of this package's code, so a fast path (a
ragged cache, a press's eviction, its correction) can be compared with it. ``masked_keep`` reads the kept set
that kvpress's masking presses leave on the attention modules (``masked_key_indices``).
"""

from __future__ import annotations

import copy

import torch
from transformers import AttentionInterface, DynamicCache

_KEEP: dict[int, torch.Tensor] = {}  # layer index -> (H_kv, n) kept set of the stored prefix, for ``dense64``


def dense64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Explicit attention (float64 on a float64 model): softmax weights over the allowed keys, causal among
    the new tokens, and on a stored prefix only the entries ``_KEEP`` keeps for this layer."""
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = hq // hkv
    k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    logits = query @ k.transpose(-1, -2) * (scaling if scaling is not None else d ** -0.5)
    i = torch.arange(q_len, device=query.device)[:, None]
    j = torch.arange(k_len, device=query.device)[None, :]
    allowed = (j <= i + (k_len - q_len)).expand(b, hq, q_len, k_len).clone()
    keep = _KEEP.get(module.layer_idx)
    if keep is not None and k_len > q_len:
        n = keep.shape[-1]
        allowed[..., :n] &= keep.to(query.device).repeat_interleave(g, dim=0)[None, :, None, :]
    weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return (weights @ v).transpose(1, 2).contiguous(), weights


AttentionInterface.register("dense64", dense64)


def float64_copy(model):
    """A float64 copy of ``model`` on the explicit attention (made before any press touched the modules)."""
    copy64 = copy.deepcopy(model).double()
    copy64.config._attn_implementation = "dense64"
    return copy64


@torch.no_grad()
def dense_reference(model64, context_ids: torch.Tensor, fed_ids: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """(T, V) float64 logits of ``fed_ids`` (1, T) after a full float64 prefill of ``context_ids`` (1, n), every
    layer's prefix restricted to ``keep`` (L, 1, H_kv, n) (None: everything), positions from n."""
    cache = DynamicCache()
    model64.model(input_ids=context_ids, past_key_values=cache)
    _KEEP.clear()
    if keep is not None:
        _KEEP.update({layer: keep[layer, 0] for layer in range(keep.shape[0])})
    n, t = context_ids.shape[1], fed_ids.shape[1]
    try:
        out = model64(input_ids=fed_ids, past_key_values=cache, position_ids=torch.arange(n, n + t)[None])
    finally:
        _KEEP.clear()
    return out.logits[0]


def masked_keep(layers, n: int) -> torch.Tensor:
    """The (L, 1, H_kv, n) kept set that kvpress's masks on the modules (``masked_key_indices``) leave."""
    heads = layers[0].self_attn.config.num_key_value_heads
    keep = torch.ones(len(layers), 1, heads, n, dtype=torch.bool)
    for layer in layers:
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            keep[layer.self_attn.layer_idx][masked[0].cpu(), masked[1].cpu(), masked[2].cpu()] = False
    return keep


__all__ = ["dense64", "dense_reference", "float64_copy", "masked_keep"]
