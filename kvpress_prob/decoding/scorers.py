"""Two kvpress ScorerPresses for compression while decoding (inside kvpress's ``DecodingPress``), the
streaming baselines.

- ``SinkWindowPress``: StreamingLLM's sinks and recent window, gathered in positional order. kvpress's
  ``StreamingLLMPress`` scores by index and ``ScorerPress.compress`` gathers its top-k unsorted, so
  under ``DecodingPress`` the cache leaves positional order after the first round and the next round's
  "first n_sink entries" are no longer the sinks.
- ``H2OPress``: heavy hitters by accumulated attention. Each round adds the attention that the queries
  buffered since the last round paid to every cached entry to the sum the entry already carries; the
  sums are gathered with the kept entries.

Both order nothing that the attention reads (the keys carry their RoPE rotation), so they drive any
model kvpress supports.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from kvpress import ScorerPress
from kvpress.utils import compute_n_kept, get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half


@dataclass
class SinkWindowPress(ScorerPress):
    """StreamingLLM (Xiao et al., 2024, arXiv 2309.17453): keep the first ``n_sink`` entries of the cache
    and the most recent ones, in positional order, so that the press can run round after round.

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the entries to remove (``DecodingPress`` sets it from its ``target_size``).
    n_sink : int, default 4
        Entries at the start of the cache that are always kept (the attention sinks).
    """

    compression_ratio: float = 0.0
    n_sink: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """Scores rising with the index (the cache is in positional order), the sinks above everything."""
        k_len = keys.shape[2]
        scores = torch.arange(k_len, device=keys.device, dtype=torch.float32)  # (k_len,)
        scores[: self.n_sink] = k_len + 1.0
        return scores.expand(keys.shape[0], keys.shape[1], k_len)  # (B, H_kv, k_len)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        k_len = keys.shape[2]
        n_kept = compute_n_kept(k_len, self.compression_ratio)
        if n_kept <= self.n_sink:
            raise ValueError(f"the press keeps {n_kept} entries of {k_len}: n_kept must exceed n_sink={self.n_sink}")
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        indices = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values  # positional order kept
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()


def buffered_attention(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Attention (B, H_q, L, k_len) of the L buffered queries (``hidden_states`` (B, L, hidden), the last L
    tokens of the stream) over the cache ``keys`` (B, H_kv, k_len, d), whose last L entries are theirs
    (causal among them). Their RoPE positions end at the current call's last ``position_ids``."""
    b, n_buf, _ = hidden_states.shape
    k_len, d = keys.shape[2], keys.shape[3]
    last = kwargs["position_ids"][:, -1:]  # (B, 1)
    positions = last - n_buf + 1 + torch.arange(n_buf, device=keys.device)  # (B, L)
    cos, sin = module.rotary_emb(hidden_states, positions)  # (B, L, d) each
    queries = get_prerope_query_states(module, hidden_states)  # (B, H_q, L, d)
    queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
    groups = module.config.num_attention_heads // keys.shape[1]
    logits = queries @ repeat_kv(keys, groups).transpose(2, 3) / math.sqrt(d)  # (B, H_q, L, k_len)
    future = torch.ones(n_buf, n_buf, dtype=torch.bool, device=keys.device).triu(1)  # (L, L): j > i
    mask = torch.zeros(n_buf, k_len, dtype=torch.bool, device=keys.device)
    mask[:, k_len - n_buf:] = future
    return logits.float().masked_fill(mask, float("-inf")).softmax(dim=-1)


@dataclass
class H2OPress(ScorerPress):
    """H2O (Zhang et al., NeurIPS 2023, arXiv 2306.14048): keep the heavy hitters, the entries with the
    largest attention accumulated over every query since they entered the cache, and the most recent
    ``n_recent`` entries. Made for kvpress's ``DecodingPress``: each round's sum covers the queries
    buffered since the last round (the prefill's queries are not seen: a DecodingPress does not act on
    the prefill), and the sums follow the kept entries from round to round.

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the entries to remove (``DecodingPress`` sets it from its ``target_size``).
    n_recent : int, default 0
        Most recent entries always kept (H2O's recent window).
    """

    compression_ratio: float = 0.0
    n_recent: int = 0
    #: cache -> {layer index -> (B, H_kv, k_len) float32}: each cache its own sums, freed with it
    accumulated: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.n_recent, int) or self.n_recent < 0:
            raise ValueError(f"n_recent must be an integer >= 0, got {self.n_recent!r}")

    def post_init_from_model(self, model):
        self.accumulated = weakref.WeakKeyDictionary()  # a new context starts with no sums

    def _sums(self, kwargs) -> dict:
        """The sums of the cache this forward runs on (layer index -> (B, H_kv, k_len))."""
        cache = kwargs["past_key_values"]
        sums = self.accumulated.get(cache)
        if sums is None:
            sums = self.accumulated[cache] = {}
        return sums

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, h_kv, k_len, _ = keys.shape
        attention = buffered_attention(module, hidden_states, keys, kwargs)  # (B, H_q, L, k_len)
        received = attention.sum(dim=2).view(b, h_kv, -1, k_len).mean(dim=2)  # (B, H_kv, k_len)
        sums = self._sums(kwargs)
        before = sums.get(module.layer_idx)
        if before is not None:
            if before.shape[2] > k_len:
                raise RuntimeError(f"layer {module.layer_idx}: {before.shape[2]} accumulated sums for {k_len} "
                                   "entries; the cache's layer was emptied and refilled without a new context")
            received[:, :, : before.shape[2]] += before
        sums[module.layer_idx] = received
        scores = received.clone()
        if self.n_recent:
            scores[:, :, -self.n_recent:] = float("inf")
        return scores

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)  # accumulates, always
        if self.compression_ratio == 0:
            return keys, values
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        indices = scores.topk(n_kept, dim=-1).indices  # (B, H_kv, n_kept)
        sums = self._sums(kwargs)
        sums[module.layer_idx] = sums[module.layer_idx].gather(2, indices)
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()
