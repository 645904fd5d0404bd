"""Allocations of KVzip's kept set across layers and heads, and eviction to a given kept set.

kvpress's ``KVzipPress`` (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
2025) keeps the global top of its reconstruction scores over all layers and heads (``kvzip_keep``, exactly its
``compress_post``): every head keeps its own count. A cache stores a layer's heads at one length, so
``allocation_keep`` offers (``ALLOCATIONS``):

- ``"padded"``: exactly kvpress's kept set, padded per layer: a diagnostic (not a candidate), which holds more
  bytes than kvpress's top-k (measured on the cache).
- ``"global"``: the global top L H ``compute_n_kept(n, r)`` of the scores (``global_keep``): snapkv's count of
  entries, and kvpress's own set up to L H rounding entries. Evicted into ``RaggedLayer``s
  (``kvpress_prob.cache``), every head holds exactly its own count: no padding, no bias.
- ``"widest"``: equal memory. The largest global top whose padded footprint, sum over layers of H times the
  layer's largest head count, fits the budget (1 - r) L H n (``widest_fit``); every head of a layer then keeps
  its own top at that width (the slots padding would leave empty hold the other heads' next entries).
- ``"ragged_fit"``: equal memory. The same largest global top, each head keeping only its share of it
  (padding left empty, with a bias).

``evict_keep`` evicts a cache down to such a set: each head's kept entries in prefix order, the padding's bias
the dtype's lowest.
"""

from __future__ import annotations

import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.correction import bias as correction

ALLOCATIONS = ("padded", "widest", "ragged_fit", "global")


def kvzip_keep(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """The (L, b, H, n) bool kept set of kvpress's ``KVzipPress.compress_post`` (``layerwise=False``) on
    ``scores`` (L, b, H, n), sinks already raised: its global count of pruned entries per layer
    (``int(numel * ratio)`` lowest), then each layer's bottom-k over its heads, as kvpress takes them."""
    L, b, H, n = scores.shape
    pruned = torch.topk(-scores.reshape(-1), int(scores.numel() * ratio)).indices
    per_layer = torch.bincount(pruned // (b * H * n), minlength=L)
    keep = torch.ones(L, b * H * n, dtype=torch.bool, device=scores.device)
    for layer in range(L):
        out = torch.topk(-scores[layer].reshape(b, -1), int(per_layer[layer]), dim=1).indices  # (b, k)
        keep[layer].view(b, H * n).scatter_(1, out, False)
    return keep.view(L, b, H, n)


def global_keep(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """The (L, b, H, n) bool global top L b H ``compute_n_kept(n, ratio)`` of ``scores`` (L, b, H, n), sinks already
    raised: snapkv's count of entries, shared over every layer and head by score."""
    L, b, H, n = scores.shape
    keep = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    keep[scores.reshape(-1).topk(L * b * H * compute_n_kept(n, ratio)).indices] = True
    return keep.view(L, b, H, n)


def top_counts(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(L, H) counts, per layer and head, of the global top ``k`` of ``scores`` (L, 1, H, n)."""
    L, _, H, n = scores.shape
    top = scores.reshape(-1).topk(k).indices if k > 0 else scores.new_zeros(0, dtype=torch.long)
    return torch.bincount(top // n, minlength=L * H).view(L, H)


def widest_fit(scores: torch.Tensor, ratio: float) -> tuple[int, torch.Tensor]:
    """(k, widths): the largest global top ``k`` of ``scores`` (L, 1, H, n) whose per-layer width (its largest
    head count, at least 1) sums to at most the budget L compute_n_kept(n, ratio) slots per head; the (L,) widths.
    A budget below one entry per layer (ratio >= 1; kvpress's count keeps at least one below) is refused."""
    L, b, H, n = scores.shape
    if b != 1:
        raise ValueError(f"scores must have batch size 1 (kvpress's KVzip scores one context), got {b}")
    budget = L * compute_n_kept(n, ratio)
    if budget < L:  # kvpress's count keeps at least one entry for any ratio in [0, 1): only ratio >= 1 gets here
        raise ValueError(f"ratio {ratio} at context length {n} leaves {budget} slots per head for {L} layers, "
                         f"below one entry per layer: ratio must be in [0, 1)")

    def width(k: int) -> torch.Tensor:
        return top_counts(scores, k).amax(dim=1).clamp(min=1)

    lo, hi = 0, L * H * n  # width(lo) fits (every width is 1 <= n), find the largest k that fits
    if int(width(hi).sum()) <= budget:
        return hi, width(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if int(width(mid).sum()) <= budget else (lo, mid)
    return lo, width(lo)


def allocation_keep(scores: torch.Tensor, ratio: float, allocation: str) -> torch.Tensor:
    """The (L, 1, H, n) kept set of ``allocation`` (``ALLOCATIONS``) on ``scores``, sinks already raised."""
    if allocation == "padded":
        return kvzip_keep(scores, ratio)
    if allocation == "global":
        return global_keep(scores, ratio)
    k, widths = widest_fit(scores, ratio)
    L, _, H, n = scores.shape
    if allocation == "ragged_fit":
        keep = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
        keep[scores.reshape(-1).topk(k).indices] = True
        keep = keep.view(L, 1, H, n)
        keep[..., 0] |= ~keep.any(-1)  # a head left empty keeps its first entry (a sink)
        return keep
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for layer, w in enumerate(widths.tolist()):
        keep[layer].scatter_(-1, scores[layer].topk(w, dim=-1).indices, True)
    return keep


def evict_keep(cache, modules, keep: torch.Tensor) -> list[list[int]]:
    """Evict ``cache`` down to ``keep`` (L, b, H, n): each layer stores its heads' kept entries in prefix order,
    padded to the layer's largest count. A layer with padding gets the correction bias (0 on kept entries,
    ``correction.padding`` on padding; 4 bytes per stored slot, as a SamplingPress's); a layer without stores
    none (``correction.store``). Returns the kept counts per layer and head."""
    counts_all = []
    for module in modules:
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values  # (b, H, n, d)
        k = keep[module.layer_idx].to(keys.device)
        counts = k.sum(dim=-1)  # (b, H)
        n_stored = max(1, int(counts.max()))
        order = (~k).to(torch.int8).argsort(dim=-1, stable=True)[..., :n_stored]  # kept first, in prefix order
        index = order[..., None].expand(-1, -1, -1, keys.shape[-1])
        layer.keys, layer.values = keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()
        # a bias only where the layer holds padding: a layer without is K and V only, and decodes through the
        # model's own attention (its mask, where the model's does not fit its length, is built by the layer's own)
        is_kept = torch.arange(n_stored, device=keys.device) < counts[..., None]
        bias = torch.where(is_kept, 0.0, correction.padding(torch.float32)).to(torch.float32)
        correction.store(module, bias, cache)
        counts_all.append(counts[0].tolist())
    return counts_all


__all__ = ["ALLOCATIONS", "allocation_keep", "evict_keep", "global_keep", "kvzip_keep", "top_counts", "widest_fit"]
