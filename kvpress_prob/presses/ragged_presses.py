"""Presses whose KV heads keep their own counts, evicted for real into a ragged cache (``kvpress_prob.cache``).

A cache stores all heads of a layer at one length, so a press whose heads keep different counts either masks
(frees nothing), pads each layer to its neediest head, or flattens it to one width. These presses store each
head's kept entries in a ``RaggedLayer`` (``evict_ragged``): the cache holds exactly the kept entries' K and V,
plus the SNIS log-weight of each kept entry where the press samples, and decodes through the ragged attention
route. Each head's kept set is one of ``presses.per_head``'s (or a sampler's draw).

- ``RaggedSamplingPress``: the paper's presses (``SamplingPress``), with their global soft budget drawn at
  kvpress's count and stored without padding (``prob_min_h_ragged``).
- ``KVzipRaggedPress``: KVzip's scores; each head keeps its count in KVzip's global top, filled by the cross and
  toprest designs (``cross_kvzip_block1_a75_toprest_ragged``).
- ``RaggedAdaKVPress``: kvpress's ``AdaKVPress`` allocation over any kvpress scorer, evicted for real
  (``adakv_snapkv_ragged``).
- ``RaggedGatePress``: Fast KVzip's learned gates, each head keeping its share of their global top
  (``topk_gate_ragged``).

Each evicts through ``kvpress_prob.cache``: ``evict_ragged`` for one layer (at its hook), ``evict_layers`` for every
layer at once (a press that chose them together: the KVzip presses through ``KVzipSampledPress.evict_scores``), both
refusing what ``check_evictable`` refuses; what a layer then holds is read through ``cache.held_bytes`` and its kin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress import AdaKVPress
from kvpress.presses.base_press import is_prefilling
from torch import nn
from transformers import Cache

from kvpress_prob.cache import check_evictable, evict_layers, evict_ragged, held_bytes, held_counts, widest_held
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.per_head import adakv_keep, global_counts, global_top, kvpress_count_ratio
from kvpress_prob.presses.prefill_plan import PrefillPlan, adakv_plan
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.samplers.cross import CrossStratifiedSampler, CrossTopSampler


@dataclass
class RaggedSamplingPress(SamplingPress):
    """The paper's probabilistic eviction (Geh, Chen, Israel, Grover, Van den Broeck, "A Probabilistic
    Interpretation of KV Cache Eviction", 2026) stored without padding: each KV head keeps what it drew.

    ``SamplingPress`` with two changes. Each layer becomes a ``RaggedLayer`` holding exactly its heads' kept
    entries and, where the press corrects, each kept entry's log-weight / temperature as its SNIS bias (in the
    ``bias_dtype``); nothing is padded. The draw's expected kept count is kvpress's count
    ``compute_n_kept(n, r)`` per head over the budget's scope (``per_head.kvpress_count_ratio``), snapkv's count
    of entries, where ``SamplingPress`` expects (1 - r) n (up to one entry more per head). Decoding runs through
    the ragged attention route (``kvpress_prob.cache.ragged_attention``).

    Parameters
    ----------
    proposal, sampler, compression_ratio, temperature, correct, budget, seed, bias_dtype, prefill
        As ``SamplingPress``'s.
    """

    def draw_ratio(self, n: int) -> float:
        """The ratio whose expected count is kvpress's, ``compute_n_kept(n, compression_ratio)`` per head."""
        return kvpress_count_ratio(n, self.compression_ratio)

    def store(self, cache: Cache, module: nn.Module, keep: torch.Tensor, log_weight: torch.Tensor,
              tau: float) -> tuple[int, int, int]:
        """Evict layer ``module.layer_idx`` to ``keep`` (1, H_kv, n) in a ``RaggedLayer`` with log_weight / ``tau``
        at the kept entries as its bias (none when tau is inf or every weight is 1); the layer sits on its
        module's device. Returns (its widest head's count, bytes of K and V held, bytes of the bias held)."""
        keys = cache.layers[module.layer_idx].keys  # (1, H_kv, n, d)
        dtype = keys.dtype if self.bias_dtype == "keys" else torch.float32
        bias = None if tau == float("inf") else torch.where(keep, log_weight / tau, 0.0).to(dtype)  # (1, H_kv, n)
        layer = evict_ragged(cache, module.layer_idx, keep, bias, device=next(module.parameters()).device)
        return widest_held(layer), *held_bytes(layer)


@dataclass
class KVzipRaggedPress(KVzipSampledPress):
    """KVzip's reconstruction scores (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction", 2025), each KV head keeping its own count, evicted for real into a ragged cache.

    Each head's count k_h is what it holds of the global top ``L H compute_n_kept(n, r)`` of KVzip's scores
    (``per_head.global_counts``: snapkv's count of entries in all, kvpress ``KVzipPress``'s allocation). The
    ``sampler`` fills each head's k_h (``CrossStratifiedSampler.keep_counts``): the ``alpha`` share as KVzip's top
    blocks, the rest from the ``tail`` proposal (pi_min-h), by its top (``CrossTopSampler``, weight 1: no bias) or
    by priority sampling (``CrossStratifiedSampler``, with its log-weights stored as the SNIS bias where
    ``correct``). Each layer becomes a ``RaggedLayer``.

    Parameters
    ----------
    compression_ratio, seed, correct, floor, n_sink, chunk_size, kvzip_plus_normalization
        As ``KVzipSampledPress``'s.
    sampler : CrossStratifiedSampler or CrossTopSampler
        The design filling each head's count (required, with ``tail``).
    tail : Proposal
        The proposal the rest is chosen from (``MinVarianceProposal(harmonic=True)``).
    """

    def __post_init__(self):
        if type(self.sampler) not in (CrossStratifiedSampler, CrossTopSampler):
            raise ValueError(f"sampler must be a CrossStratifiedSampler or CrossTopSampler (their keep_counts fill "
                             f"each head's own count), got {type(self.sampler).__name__}")
        if self.layers or self.widest:
            raise ValueError("layers and widest set one count per layer: a ragged press keeps each head's own")
        super().__post_init__()
        self.kept: list[list[int]] = []

    def unused_fields(self) -> set[str]:
        """``layerwise``, ``budget``, ``layers`` and ``widest`` (each head's count is its share of the global top);
        under a deterministic sampler also ``seed``, ``correct`` (every kept entry weighs 1) and ``floor`` (the
        uniform mixture does not reorder a head's scores, and each head keeps its own count)."""
        fixed = set() if self.sampler.random else {"seed", "correct", "floor"}
        return {"layerwise", "budget", "layers", "widest"} | fixed

    def evict_scores(self, model, scores: torch.Tensor) -> None:
        """Evict each head to its count of the global top of the pinned ``scores`` (L, 1, H, n)."""
        counts = global_counts(scores, self.compression_ratio)  # (L, 1, H)
        generator = torch.Generator(device=scores.device).manual_seed(self.seed)
        draw = self.sampler.keep_counts(self.proposals(scores), counts, generator)
        bias = None
        if self.sampler.random and self.correct:  # the log-weights, in the keys' dtype
            bias = torch.where(draw.keep, draw.log_weight, 0.0).to(self._cache.layers[0].keys.dtype)
        evict_layers(self._cache, draw.keep, bias)
        self.kept = counts[:, 0].tolist()


@dataclass
class RaggedAdaKVPress(AdaKVPress):
    """kvpress's ``AdaKVPress`` (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
    for Efficient LLM Inference", 2024) evicted for real: the same kept set, in a ragged cache.

    kvpress's AdaKV masks the entries it evicts (``masked_key_indices``: the full K and V stay on the cache). Here
    each layer, at its own prefill hook, keeps ``per_head.adakv_keep`` of its ``press``'s scores (each head's
    safeguard top, then the layer's top ``H compute_n_kept(n, r)``) and becomes a ``RaggedLayer`` of exactly those
    entries; no mask is left on the module.

    Parameters
    ----------
    press : ScorerPress
        The kvpress scorer (its ``compression_ratio`` is this press's).
    alpha_safeguard : float, default 0.20
        Share of kvpress's count each head keeps at least, in [0, 1].
    """

    def prefill_plan(self, model, n: int) -> PrefillPlan:
        """After a shared full-cache prefill: as kvpress's ``AdaKVPress`` (``adakv_plan``), evicting its set."""
        return adakv_plan(self)

    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """At prefill, score this layer, keep AdaKV's set, and replace the layer by a ``RaggedLayer``."""
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]) or self.compression_ratio == 0:
            return output
        cache = kwargs["past_key_values"]
        check_evictable(cache, hidden_states.shape[0], "RaggedAdaKVPress")
        layer = cache.layers[module.layer_idx]
        scores = self.press.score(module, hidden_states, layer.keys, layer.values, output[1], kwargs)  # (1, H, n)
        evict_ragged(cache, module.layer_idx, adakv_keep(scores, self.compression_ratio, self.alpha_safeguard))
        return output


@dataclass
class RaggedGatePress(GatePress):
    """Fast KVzip's learned gates (Kim, Han, Yun, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV
    Eviction", arXiv 2601.17668) with a per-head allocation, evicted for real into a ragged cache.

    ``GatePress``'s scores (the gate of each layer, sinks pinned), kept as their global top
    ``L H compute_n_kept(n, r)`` over every layer and head (``per_head.global_top``: snapkv's count of entries,
    KVzip's allocation) instead of the widest allocation; each layer becomes a ``RaggedLayer``, no bias.

    Parameters
    ----------
    compression_ratio, gate, n_sink
        As ``GatePress``'s.
    """

    def evict(self, cache, scores: torch.Tensor) -> list[list[int]]:
        """Evict ``cache`` to the global top of the pinned ``scores`` (L, 1, H, n); the kept counts per head."""
        keep = global_top(scores, self.compression_ratio)  # (L, 1, H, n), a row per attention module, in order
        layers = evict_layers(cache, keep, layers=[module.layer_idx for module in self._attention])
        return [list(held_counts(layer)) for layer in layers]


__all__ = ["KVzipRaggedPress", "RaggedGatePress", "RaggedAdaKVPress", "RaggedSamplingPress", "held_bytes"]
