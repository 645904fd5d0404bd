"""Which stream positions a compressed cache holds: each cached key of a layer matched to the nearest key
of the full cache of the same stream (on layer 0 a key depends only on its token and position, so the
match is exact up to float rounding). The diagnostic behind docs/streaming.md's kvpress finding."""

from __future__ import annotations

import torch


def positions_held(keys: torch.Tensor, full_keys: torch.Tensor) -> torch.Tensor:
    """Positions (H_kv, k) of the cached ``keys`` (1, H_kv, k, d) in ``full_keys`` (1, H_kv, n, d), in the
    cache's order, by the nearest full key of the same head."""
    distance = torch.cdist(keys[0].float(), full_keys[0].float())  # (H_kv, k, n)
    return distance.argmin(dim=-1)
