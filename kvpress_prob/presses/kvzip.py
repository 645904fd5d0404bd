"""KVzip's scores under our budgets and designs: an equal-memory KVzip and sampling from its scores.

kvpress's ``KVzipPress`` (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", 2025) scores each cached entry by the largest attention it receives while the model
is asked to repeat the context, then masks the lowest-scored entries over all layers and heads: it
frees nothing (the masked entries stay in the cache) and its layers keep different counts.
``KVzipSampledPress`` keeps kvpress's scoring pass and replaces the masking by a real eviction through
``SamplingPress.evict``: the scores, shifted to be non-negative and mixed with a uniform floor, are the
proposal pi of each layer, and the ``sampler`` under ``budget`` chooses what is kept (``TopKSampler``
with a per-head budget: kvpress's per-head count, the equal-memory twin of ``kvzip``;
``PrioritySampler``: sampled, with the SNIS correction; a ``StratifiedSampler`` in a ``BlockSampler``:
exact blocks plus a sampled rest). With a ``tail`` proposal (pi_min-h), computed in the prefill's own
hooks, and a ``CrossStratifiedSampler``, KVzip's top blocks are the exact set and the rest is sampled
from the tail proposal with its correction (``cross_kvzip_block8_a<pct>``).

The reconstruction passes cost two to three prefills. ``BoundedKVzipPress`` (``presses.kvzip_scoring``)
scores in the reconstruction forwards' own attention (``presses.kvzip_fused``), runs them at bounded memory and keeps their scores per model and context, so that every ratio and seed of
one context reuses them; it refuses eager attention and a batch, and under ``model.generate`` it scores and compresses at the first
decoding forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.samplers.cross import CrossStratifiedSampler
from kvpress_prob.proposals.pairs import UniformProposal
from kvpress_prob.proposals.base import Proposal
from kvpress_prob.presses.allocations import widest_fit
from kvpress_prob.presses.kvzip_scoring import BoundedKVzipPress
from kvpress_prob.presses.prefill_plan import PrefillPlan
from kvpress_prob.presses.sampling import SamplingPress, language_model
from kvpress_prob.samplers import Sampler, TopKSampler
from kvpress_prob.samplers.base import ratio_keeping

@dataclass
class KVzipSampledPress(BoundedKVzipPress):
    """KVzip's reconstruction scores, kept by one of our designs with real eviction (see the module).

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the cache evicted, in [0, 1).
    sampler : Sampler, default TopKSampler()
        The design choosing the kept entries from pi.
    budget : {"global", "layer", "head"}, default "head"
        The budget's scope (``SamplingPress``); "head" keeps kvpress's count in every head.
    seed : int, default 0
        Seed of a random design.
    correct : bool, default True
        Install the SNIS correction of a random design (a top-k design keeps weight 1 everywhere).
    floor : float, default 0.01
        Mass of the uniform component mixed into pi (every entry can be drawn).
    layers : bool, default False
        KVzip's allocation over layers: each layer keeps, in every head, its share of the global top
        (1 - r) L H n entries of KVzip's scores divided by its H heads (rounded down), so the layers
        differ and the heads of a layer do not (no padding; at most kvpress's bytes). False: the
        ``budget`` scope over the draw.
    widest : bool, default False
        The widest allocation (``topk_kvzip_widest``'s): each layer gets the width ``widest_fit`` gives it, the
        largest count of any of its heads in the largest global top of KVzip's scores whose widths fit
        L compute_n_kept(n, r) slots per head, and every head of the layer keeps that many (no padding, at
        most kvpress's bytes). The ``sampler`` then chooses which, within the layer's width. Not with
        ``layers``.
    tail : Proposal or None, default None
        A second proposal computed from the prefill (``MinVarianceProposal(harmonic=True)``): pi is then
        (b, H, 2, n), KVzip's row first, for a ``CrossStratifiedSampler`` (required with it).
    n_sink, chunk_size, kvzip_plus_normalization, layerwise : kvpress ``KVzipPress``'s (``layerwise``
        is unused: the budget says how the layers share it).
    """

    sampler: Sampler = field(default_factory=TopKSampler)
    budget: str = "head"
    seed: int = 0
    correct: bool = True
    floor: float = 0.01
    layers: bool = False
    tail: Proposal | None = None
    widest: bool = False

    def __post_init__(self):
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"floor must be in [0, 1), got {self.floor}")
        if (self.tail is not None) != isinstance(self.sampler, CrossStratifiedSampler):
            raise ValueError("tail (a Proposal) and a CrossStratifiedSampler sampler go together")
        if self.layers and self.widest:
            raise ValueError("layers and widest are two allocations over layers: set one")
        self._tails: dict[int, torch.Tensor] = {}
        self.evictor()  # checks the ratio, budget and sampler now
        super().__post_init__()

    @property
    def allocated(self) -> bool:
        """Whether an allocation over layers (``layers`` or ``widest``) sets every head's count."""
        return self.layers or self.widest

    def evictor(self, compression_ratio: float | None = None) -> SamplingPress:
        """The SamplingPress that evicts (its proposal is unused: pi comes from KVzip's scores)."""
        ratio = self.compression_ratio if compression_ratio is None else compression_ratio
        return SamplingPress(proposal=UniformProposal(), sampler=self.sampler, compression_ratio=ratio,
                             budget="head" if self.allocated else self.budget, seed=self.seed,
                             correct=self.correct)

    def unused_fields(self) -> set[str]:
        """The fields this press ignores, whose overrides ``get_press`` refuses: ``layerwise``, ``budget`` under
        ``layers`` or ``widest`` (every head keeps its layer's count); under a deterministic sampler ``seed``,
        ``correct`` (every kept entry weighs 1) and, where each head keeps its own count (``budget`` "head", or
        an allocation), ``floor`` (the uniform mixture does not reorder a head's scores)."""
        unused = {"layerwise"} | ({"budget"} if self.allocated else set())
        if not self.sampler.random:
            unused |= {"seed", "correct"} | ({"floor"} if self.allocated or self.budget == "head" else set())
        return unused

    def layer_counts(self, scores: torch.Tensor) -> list[int]:
        """Per layer, the entries each head keeps under KVzip's allocation (``layers``): the layer's share of
        the global top (1 - r) L H n of ``scores`` (L, b, H, n), divided by H and rounded down (at least 1)."""
        L, b, H, n = scores.shape
        total = L * b * H * compute_n_kept(n, self.compression_ratio)
        flat = scores.reshape(-1)
        top = flat.topk(total).indices if total > 0 else flat.new_zeros(0, dtype=torch.long)
        per_layer = torch.bincount(top // (b * H * n), minlength=L)
        return [max(1, min(n, int(c) // (b * H))) for c in per_layer]

    @contextmanager
    def __call__(self, model):
        """kvpress KVzip's context; with a ``tail``, its proposal is computed at each layer of the prefill."""
        self._tails = {}
        handles = []
        if self.tail is not None:
            handles = [layer.self_attn.register_forward_hook(self._tail_hook, with_kwargs=True)
                       for layer in language_model(model).layers]
        try:
            with super().__call__(model):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._tails = {}

    @torch.no_grad()
    def tail_proposal(self, module, kwargs: dict) -> torch.Tensor:
        """One layer's ``tail`` proposal (b, H, n) from the keyword arguments of its attention module's prefill
        forward (``hidden_states``, ``past_key_values`` holding the layer's full keys and values, ...)."""
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        return self.tail(module, kwargs["hidden_states"], layer.keys, layer.values, kwargs)

    def _tail_hook(self, module, args, kwargs, output):
        if module.layer_idx not in self._tails:  # else a reconstruction pass: the prefill's proposal is kept
            self._tails[module.layer_idx] = self.tail_proposal(module, kwargs)
        return output

    def prefill_plan(self, model, n: int) -> PrefillPlan:
        """After a shared full-cache prefill: ``compress`` on that prefill's cache, as its own prefill would have
        left it, with its ``tail`` proposals (if any) computed in the shared prefill's hooks, keyed by the tail
        (shared by every ratio and seed); at ratio 0, a prefill of its own."""
        if self.compression_ratio == 0:
            return PrefillPlan("prefill")
        if self.tail is None:
            return PrefillPlan("kvzip")
        return PrefillPlan("kvzip", ("tail", repr(self.tail)),
                           lambda module, kwargs, output: self.tail_proposal(module, kwargs))

    def pinned_scores(self) -> torch.Tensor:
        """KVzip's scores (L, b, H, n) in float32, the sinks above every other entry (never evicted)."""
        scores = self.score_val.float().clone()
        scores[..., : self.n_sink] = scores.amax() + 1.0
        return scores

    def proposals(self, scores: torch.Tensor) -> torch.Tensor:
        """pi (L, b, H, n) from KVzip's ``scores`` (L, b, H, n): shifted to be non-negative, mixed with the uniform
        ``floor``; with a ``tail``, (L, b, H, 2, n), KVzip's row first (it chooses the exact set), the tail's second."""
        w = scores - scores.amin(dim=-1, keepdim=True)
        w = torch.where(w.sum(-1, keepdim=True) > 0, w, torch.ones_like(w))
        pi = (1 - self.floor) * w / w.sum(-1, keepdim=True) + self.floor / w.shape[-1]
        if self.tail is not None:
            pi = torch.stack([pi, torch.stack([self._tails[i].to(pi.device).float() for i in range(len(pi))])], dim=3)
        return pi

    @torch.no_grad()
    def compress_post(self, model):
        """Keep the scores for later ratios and seeds (``remember``), then evict the cache to the pinned scores
        (``evict_scores``): the one place every KVzip press of this package evicts from."""
        self.remember(model)
        if self.compression_ratio == 0:
            return
        self.evict_scores(model, self.pinned_scores())

    def evict_scores(self, model, scores: torch.Tensor) -> None:
        """Evict ``self._cache`` to the pinned ``scores`` (L, b, H, n) through ``SamplingPress.evict``: the
        ``budget``'s scope, or each layer's count under an allocation over layers."""
        pi = self.proposals(scores)
        modules = [layer.self_attn for layer in language_model(model).layers]
        if not self.allocated:
            self.evictor().evict(self._cache, {m: pi[m.layer_idx].to(self._cache.layers[m.layer_idx].keys.device)
                                                for m in modules})
            return
        n = scores.shape[-1]
        counts = widest_fit(scores, self.compression_ratio)[1].tolist() if self.widest else self.layer_counts(scores)
        for m, k in zip(modules, counts):
            self.evictor(ratio_keeping(k, n)).evict(self._cache, {m: pi[m.layer_idx].to(self._cache.layers[m.layer_idx].keys.device)})


__all__ = ["KVzipSampledPress"]
