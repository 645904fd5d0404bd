"""Which prefix positions a compressed cache holds, per layer and KV head, and whether a needle survives whole."""

from __future__ import annotations

import torch

from evaluation.engine import Prefill
from kvpress_prob import SamplingPress


def _row_hash(x: torch.Tensor) -> torch.Tensor:
    """An exact integer fingerprint of each row of x (..., d): equal rows, equal hashes (int64 sums
    wrap deterministically whatever the order)."""
    bits = x.contiguous().view(torch.int16).long()  # (..., 2d or d)
    coeff = torch.arange(1, bits.shape[-1] + 1, dtype=torch.int64, device=x.device) * 2654435761 + 97
    return (bits * coeff).sum(-1)


@torch.no_grad()
def kept_positions(prefill: Prefill, cache, press) -> torch.Tensor:
    """(L, H_kv, n) bool: which prefix positions each head of each layer still holds."""
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
            held = cache.layers[layer_idx].keys[0]  # (H, k, d)
            full_hash, held_hash = _row_hash(full), _row_hash(held)
            keep = (full_hash[:, :, None] == held_hash[:, None, :]).any(-1)  # (H, n)
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
