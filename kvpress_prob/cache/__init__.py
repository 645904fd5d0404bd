"""The ragged cache: each KV head of a layer holds its own kept entries, read by its own attention route."""

from kvpress_prob.cache.folded import FoldedLayer
from kvpress_prob.cache.held import head_entries, held_counts
from kvpress_prob.cache.ragged import RaggedLayer, evict_ragged

__all__ = ["FoldedLayer", "RaggedLayer", "evict_ragged", "head_entries", "held_counts"]
