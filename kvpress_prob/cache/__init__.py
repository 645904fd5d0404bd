"""The ragged cache: every KV head of a layer holds its own kept entries (``ragged``), decoded by its own
attention route (``attention``)."""

from kvpress_prob.cache.ragged import RaggedLayer, evict_ragged

__all__ = ["RaggedLayer", "evict_ragged"]
