"""The ragged cache (each KV head holds its own kept entries) and the one reader of what any cache layer holds."""

from kvpress_prob.cache.folded import FoldedLayer
from kvpress_prob.cache.held import (cache_held_bytes, head_entries, held_bytes, held_counts, kept_positions,
                                     layer_bias, mean_kept, padded_view, prompt_entries, widest_held)
from kvpress_prob.cache.ragged import RaggedLayer, check_evictable, evict_layers, evict_ragged, storage_bytes

__all__ = ["FoldedLayer", "RaggedLayer", "cache_held_bytes", "check_evictable", "evict_layers", "evict_ragged",
           "head_entries", "held_bytes", "held_counts", "kept_positions", "layer_bias", "mean_kept", "padded_view",
           "prompt_entries", "storage_bytes", "widest_held"]
