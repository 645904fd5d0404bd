"""Which prefix positions a compressed cache holds, per layer and KV head, and whether a needle survives whole."""

from __future__ import annotations

import torch

from kvpress_prob import SamplingPress
from kvpress_prob.cache import kept_positions as held_positions


@torch.no_grad()
def kept_positions(prefill, cache, press) -> torch.Tensor:
    """(L, H_kv, n) bool: which prefix positions each head of each layer still holds. ``prefill``: the shared
    prefill the cache was compressed from (``evaluation.engine.Prefill``: its ``layers`` and ``source_keys``);
    a sampled press's own draw where it has one, kvpress AdaKV's masks, else each layer's held keys matched to
    the full keys (``kvpress_prob.cache.kept_positions``)."""
    if isinstance(press, SamplingPress) and press.compression_ratio > 0:
        return press.last_draw.keep[:, 0].cpu()
    masks, source = [], prefill.source_keys(press)
    for layer_idx, layer in enumerate(prefill.layers):
        full = source[layer_idx][0]  # (H, n, d)
        h, n = full.shape[:2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)  # kvpress AdaKV: masks, keeps all
        if masked is not None:
            keep = torch.ones(h, n, dtype=torch.bool, device=full.device)
            keep[masked[1], masked[2]] = False
        else:
            keep = held_positions(cache.layers[layer_idx], full)[0]  # (H, n)
        masks.append(keep.cpu())
    return torch.stack(masks)


def survival(keep: torch.Tensor, needles: list[list[int]]) -> dict:
    """Fraction of (layer, head) pairs in which every token of a needle survives, averaged over the
    needles found, overall and per layer."""
    found = [p for p in needles if p]
    if not found:
        return {"survival": None, "per_layer": None}
    whole = torch.stack([keep[:, :, p].all(-1) for p in found]).double()  # (values, L, H)
    return {"survival": float(whole.mean()), "per_layer": whole.mean((0, 2)).tolist()}
