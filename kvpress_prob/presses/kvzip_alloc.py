"""KVzip's kept set under an allocation across the heads of a layer, with real eviction.

``KVzipAllocatedPress`` keeps KVzip's scores (``KVzipSampledPress``'s reconstruction pass and score cache) and
evicts for real to the kept set of one of ``presses.allocations.ALLOCATIONS``: ``"padded"`` (kvpress's own kept
set, padded: a diagnostic), ``"widest"`` (equal memory, no padding, no bias: its cache is K and V only and
decodes through the model's own attention), ``"ragged_fit"`` (equal memory, padding with a bias) or
``"global"`` (the global top of snapkv's count of entries, each head holding exactly its own count in a
``RaggedLayer`` of ``kvpress_prob.cache``, decoded by its ragged attention route).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_prob.cache import evict_layers, held_counts
from kvpress_prob.presses.allocations import ALLOCATIONS, allocation_keep, evict_keep
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.sampling import language_model


@dataclass
class KVzipAllocatedPress(KVzipSampledPress):
    """KVzip's reconstruction scores (Kim et al. 2025, arXiv 2505.23416), kept under an allocation across heads,
    evicted for real (see the module).

    Parameters
    ----------
    allocation : {"padded", "widest", "ragged_fit", "global"}, default "widest"
        "padded": kvpress's own kept set, padded (a diagnostic, more bytes); "widest" and "ragged_fit": the
        largest global top whose padded footprint fits (1 - r) of the cache (equal memory); "global": the global
        top L H compute_n_kept(n, r), stored ragged (snapkv's count of entries, exactly).
    compression_ratio, n_sink, chunk_size, kvzip_plus_normalization : ``KVzipSampledPress``'s (its sampler,
        budget, seed, floor, layers and tail are unused).
    """

    allocation: str = "widest"

    def __post_init__(self):
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        super().__post_init__()
        self.kept: list[list[int]] = []

    def unused_fields(self) -> set[str]:
        """The ``KVzipSampledPress`` fields this press ignores (``get_press`` refuses overrides of them)."""
        return {"sampler", "budget", "seed", "correct", "floor", "layers", "tail", "layerwise"}

    def evict_scores(self, model, scores: torch.Tensor) -> None:
        """Evict ``self._cache`` to the allocation's set of the pinned ``scores`` (L, b, H, n)."""
        keep = allocation_keep(scores, self.compression_ratio, self.allocation)  # (L, b, H, n)
        if self.allocation == "global":
            self.kept = [list(held_counts(layer)) for layer in evict_layers(self._cache, keep)]
            return
        self.kept = evict_keep(self._cache, [layer.self_attn for layer in language_model(model).layers], keep)


__all__ = ["KVzipAllocatedPress"]
