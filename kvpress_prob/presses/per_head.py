"""Per-head kept sets: each KV head keeps its own count, for a cache that stores each head at its own length.

Pure functions of scores (no cache, no model): they say which entries each head keeps, and the presses of
``presses.ragged_presses`` evict the rest for real.

- ``global_top``: the top ``L b H compute_n_kept(n, r)`` of scores over every layer and head (snapkv's count of
  entries in all; each head keeps what it holds of that top).
- ``global_counts``: each head's count in that top, (L, b, H).
- ``adakv_keep``: kvpress's ``AdaKVPress`` kept set of one layer (Feng et al., "Ada-KV: Optimizing KV Cache
  Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024): each head's safeguard top, then the
  layer's top over its heads, ``H compute_n_kept(n, r)`` entries in all.
- ``kvpress_count_ratio``: the compression ratio whose expected kept count ``(1 - r') n`` is kvpress's count
  ``compute_n_kept(n, r)``, so a sampled budget draws snapkv's count of entries in expectation.
"""

from __future__ import annotations

import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.samplers.base import check_ratio, ratio_keeping


def kvpress_count_ratio(n: int, compression_ratio: float) -> float:
    """r' with (1 - r') n = compute_n_kept(n, r) to 1e-15: a design whose expected count per head is (1 - r') n
    keeps kvpress's (and snapkv's) count in expectation. 0 stays 0 (nothing evicted)."""
    check_ratio(compression_ratio)
    if compression_ratio == 0:
        return 0.0
    return ratio_keeping(compute_n_kept(n, compression_ratio), n)


def global_counts(scores: torch.Tensor, compression_ratio: float) -> torch.Tensor:
    """(L, b, H) long: how many of the global top ``L b H compute_n_kept(n, r)`` of ``scores`` (L, b, H, n)
    each head holds (``global_top``'s counts)."""
    return global_top(scores, compression_ratio).sum(-1)


def global_top(scores: torch.Tensor, compression_ratio: float) -> torch.Tensor:
    """(L, b, H, n) bool: the ``L b H compute_n_kept(n, r)`` largest ``scores`` (L, b, H, n) over every layer
    and head (ties broken as ``torch.topk`` breaks them). r = 0 keeps everything."""
    check_ratio(compression_ratio)
    if scores.dim() != 4:
        raise ValueError(f"scores must be (L, b, H, n), got shape {tuple(scores.shape)}")
    L, b, H, n = scores.shape
    total = L * b * H * compute_n_kept(n, compression_ratio)
    keep = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    keep[scores.reshape(-1).topk(total).indices] = True
    return keep.view(L, b, H, n)


def adakv_keep(scores: torch.Tensor, compression_ratio: float, alpha_safeguard: float = 0.20) -> torch.Tensor:
    """(b, H, n) bool: kvpress ``AdaKVPress.compress``'s kept set on one layer's ``scores`` (b, H, n).

    k = compute_n_kept(n, r) per head on average: every head first keeps its top ``int(alpha_safeguard k)`` (at
    least 1 when alpha_safeguard > 0), then the layer keeps the top ``H k`` of all its scores, those safeguarded
    counting first; kvpress masks the other ``H (n - k)`` entries, here they are the entries not kept."""
    check_ratio(compression_ratio)
    if not 0.0 <= alpha_safeguard <= 1.0:
        raise ValueError(f"alpha_safeguard must be in [0, 1], got {alpha_safeguard}")
    if scores.dim() != 3:
        raise ValueError(f"scores must be (b, H, n), got shape {tuple(scores.shape)}")
    b, H, n = scores.shape
    k = compute_n_kept(n, compression_ratio)
    n_safe = int(k * alpha_safeguard)
    if alpha_safeguard > 0:
        n_safe = max(1, n_safe) if k > 0 else 0
    raised = scores.clone()
    raised.scatter_(-1, scores.topk(n_safe, dim=-1).indices, torch.finfo(scores.dtype).max)
    pruned = (-raised.reshape(b, H * n)).topk(H * (n - k), dim=1).indices  # (b, H (n - k)), as kvpress takes them
    keep = torch.ones(b, H * n, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, pruned, False)
    return keep.view(b, H, n)


__all__ = ["adakv_keep", "global_counts", "global_top", "kvpress_count_ratio"]
