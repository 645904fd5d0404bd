"""Prefill once (``Prefill``): each example's context is prefilled once with the full cache, told the
presses it will serve. Its attention hooks compute, layer by layer and from what each hook sees,
what those presses need (``plan``: what each press declares in its ``prefill_plan``, kvpress's own
read from kvpress's interface): a ``SamplingPress``'s proposal through ``propose``, a kvpress
scorer's scores through its ``score``, each computed once per example and distinct proposal or
scorer, and shared by every ratio and seed (the stored tensors are keyed without the ratio; a
scorer whose scores read it, StreamingLLM's, has one per ratio: ``scores_read_ratio``). Only
those (b, H_kv, n) tensors are kept, never the hook inputs (a layer's hidden states weigh more
than its K+V).

Compress many
(``Prefill.compress``): each press then compresses a cache that starts as the prefill's own tensors
(nothing is copied: presses gather or mask), through the presses' public API only: a
``SamplingPress`` through ``evict``, a kvpress scorer through its ``forward_hook`` on the stored
scores (``ReplayedScores``; AdaKV's around them). This is exactly what the hooks would have done in a
real prefill: compression happens after a layer's attention, so no layer's input depends on another
layer's compression. H2O reads eager attention weights: one eager prefill per example keeps each
layer's scores (kvpress's own ``ObservedAttentionPress.score``) and its keys and values (they differ
from sdpa's in the last bits), unless its eager attention would exceed the press's
``max_eager_bytes`` (its scores are then computed in chunks in the shared prefill; kvpress's own
``ObservedAttentionPress`` too, above the default 4 GiB: no path builds the n x n weights). A gate press
(``GatePress`` and ``LayerGatePress``) has its gate's scores computed in the shared prefill's hooks, once per gate
and shared by every ratio, and evicts through its ``compress_scores``. A KVzip press
(``KVzipSampledPress`` and its subclasses) starts from the shared prefill's cache, as its own prefill would
have left it, and runs its reconstruction passes (or reuses their scores) and its eviction on that; its
``tail`` proposal, if any, is computed in the shared prefill's hooks. A press of any other family is
compressed by a prefill under it (``press_prefill``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from kvpress import AdaKVPress, BasePress, ObservedAttentionPress
from kvpress.presses.scorer_press import ScorerPress
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvpress_prob import SamplingPress
from kvpress_prob.cache import cache_held_bytes, held_bytes, mean_kept
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.presses.h2o import EagerObservedAttentionPress
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.prefill_plan import PrefillPlan as Plan
from kvpress_prob.presses.prefill_plan import adakv_plan, scores_plan, standard_scorer
from kvpress_prob.presses.spans import SpanPress


@dataclass
class ReplayedScores(ScorerPress):
    """kvpress's top-k (``ScorerPress.compress``) on scores computed earlier, per layer: how every
    ratio of a scorer press reuses the scores computed in one prefill's hooks.

    Parameters
    ----------
    compression_ratio : float
        Fraction of key-value pairs removed.
    scores : dict[int, torch.Tensor]
        Layer index -> (b, H_kv, n) scores.
    """

    scores: dict = field(default_factory=dict)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.scores[module.layer_idx].clone()  # AdaKV writes into its scores


def plan(model, press: BasePress | None, n: int) -> Plan:
    """The ``Plan`` of ``press`` for a context of ``n`` tokens (``post_init_from_model`` is run first,
    as entering the press would): the one it declares (``prefill_plan``), else ``kvpress_plan``'s."""
    if press is None:
        return Plan("full")
    press.post_init_from_model(model)
    declared = getattr(press, "prefill_plan", None)
    return declared(model, n) if declared is not None else kvpress_plan(model, press, n)


def kvpress_plan(model, press: BasePress, n: int) -> Plan:
    """The plan of a press that declares none (kvpress's own), read from kvpress's interface: H2O's as our
    eager H2O's (no path builds n x n weights that do not fit), a scorer's top-k of its stored scores, AdaKV's
    allocation of its scorer's; any other, a prefill of its own."""
    if isinstance(press, ObservedAttentionPress) and standard_scorer(press):
        return EagerObservedAttentionPress().prefill_plan(model, n)
    if standard_scorer(press):
        return scores_plan(press)
    if type(press) is AdaKVPress:
        return adakv_plan(press)
    return Plan("prefill")


@torch.no_grad()
def hooked_prefill(model, layers, context_ids: torch.Tensor, on_layer, max_eager_bytes: float = 2**32) -> DynamicCache:
    """A full-cache prefill calling ``on_layer(module, kwargs, output)`` at each attention layer's
    forward (its hook inputs are not kept). On eager attention, refused above ``max_eager_bytes`` of
    one layer's (b, H_q, n, n) float32 weights (no path builds what does not fit)."""
    need = EagerObservedAttentionPress.eager_bytes(model, context_ids.shape[1], context_ids.shape[0])
    if model.config._attn_implementation == "eager" and need > max_eager_bytes:
        raise ValueError(
            f"an eager prefill of {context_ids.shape[1]} tokens builds {need / 2**30:.1f} GiB of attention weights per "
            f"layer, above max_eager_bytes={max_eager_bytes:.0f}: load the model with attn_implementation='sdpa' "
            f"(H2O's scores are then computed in chunks) or raise max_eager_bytes")
    rotary = language_model(model).rotary_emb
    cache = DynamicCache()
    hooks = []
    for layer in layers:
        layer.self_attn.rotary_emb = rotary  # as kvpress's BasePress.__call__ does, for scorers that read it
        hooks.append(layer.self_attn.register_forward_hook(
            lambda module, args, kwargs, output: on_layer(module, kwargs, output), with_kwargs=True))
    try:
        model.model(input_ids=context_ids, past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    return cache


@torch.no_grad()
def press_prefill(model, context_ids: torch.Tensor, press: BasePress | None) -> DynamicCache:
    """The prefill as the kvpress pipeline runs it: ``with press(model): model.model(...)`` on a new
    cache (None: no press). What ``Prefill.compress`` replays, and what a user pays for one press."""
    cache = DynamicCache()
    if press is None:
        model.model(input_ids=context_ids, past_key_values=cache)
        return cache
    with press(model):
        model.model(input_ids=context_ids, past_key_values=cache)
    return cache


class Prefill:
    """One full-cache prefill of ``context_ids`` from which any press's compression is replayed.

    ``presses``: the presses this example will be compressed with (any number, ratios and seeds
    included). What each needs is computed layer by layer inside this prefill's hooks and kept, not
    the hook inputs: each distinct proposal of a SamplingPress (b, H_kv, n) per layer, each distinct
    kvpress scorer's scores (b, H_kv, n) per layer, distinct up to the ratio (``plan``'s keys). A press not announced here costs one more
    prefill, computing only what it needs. H2O (eager attention) has an eager prefill of its own;
    any other press is compressed by a prefill under it (``press_prefill``).
    """

    def __init__(self, model, context_ids: torch.Tensor, presses=()):
        self.model = model
        self.context_ids = context_ids
        self.n = context_ids.shape[1]
        self.layers = language_model(model).layers
        self.stored: dict[tuple, dict[int, torch.Tensor]] = {}  # plan key -> layer index -> proposal / scores
        self.prefills = 0  # prefills run so far (the shared one included)
        self._eager = None  # H2O's eager prefill: (keys, values)
        plans = [plan(model, press, self.n) for press in presses]
        self.full_cache = self._prefill({p.key: p for p in plans if p.compute is not None})  # never modified
        self.keys = [layer.keys for layer in self.full_cache.layers]
        self.values = [layer.values for layer in self.full_cache.layers]
        if any(p.kind == "eager" for p in plans):
            self._eager_prefill()

    @property
    def proposals(self) -> dict[tuple, dict[int, torch.Tensor]]:
        """The stored proposals: key -> layer index -> (b, H_kv, n)."""
        return {key: value for key, value in self.stored.items() if key[0] == "proposal"}

    def _prefill(self, plans: dict[tuple, Plan]) -> DynamicCache:
        for key in plans:
            self.stored[key] = {}

        def on_layer(module, kwargs, output):
            for key, p in plans.items():
                self.stored[key][module.layer_idx] = p.compute(module, kwargs, output)

        self.prefills += 1
        return hooked_prefill(self.model, self.layers, self.context_ids, on_layer)

    def _stored(self, p: Plan) -> dict[int, torch.Tensor]:
        if p.key not in self.stored:  # not announced: one more prefill, its cache dropped
            self._prefill({p.key: p})
        return self.stored[p.key]

    def _reset_modules(self) -> None:
        # AdaKV's mask of an earlier compress lives on the modules (a SamplingPress's correction on its own cache)
        for layer in self.layers:
            drop_masks(layer.self_attn)

    @torch.no_grad()
    def _eager_prefill(self) -> tuple[list, list]:
        """H2O reads eager attention weights, and an eager prefill's cache differs from sdpa's in the
        last bits: one eager prefill computes each layer's H2O scores (kvpress's own
        ``ObservedAttentionPress.score``) in its hooks and keeps its keys and values; every ratio uses them."""
        if self._eager is None:
            scorer, scores = ObservedAttentionPress(), {}
            previous = self.model.config._attn_implementation
            self.model.set_attn_implementation("eager")
            try:
                cache = hooked_prefill(self.model, self.layers, self.context_ids, lambda module, kwargs, output: (
                    scores.__setitem__(module.layer_idx, scores_plan(scorer).compute(module, kwargs, output))),
                    max_eager_bytes=float("inf"))  # ``plan`` chose it: the press's max_eager_bytes allows it
            finally:
                self.model.set_attn_implementation(previous)
            self.prefills += 1
            self.stored[("eager",)] = scores
            self._eager = ([c.keys for c in cache.layers], [c.values for c in cache.layers])
        return self._eager

    def source_keys(self, press: BasePress | None) -> list[torch.Tensor]:
        """Each layer's full keys (b, H_kv, n, d) that ``press`` compresses from: the eager
        prefill's for H2O run on eager attention (its keys differ from sdpa's in the last bits),
        else the sdpa prefill's."""
        return self._eager_prefill()[0] if plan(self.model, press, self.n).kind == "eager" else self.keys

    @torch.no_grad()
    def proposals_of(self, press: SamplingPress) -> dict[torch.nn.Module, torch.Tensor]:
        """Each attention module's proposal (b, H_kv, n) for ``press``, computed once per example and
        distinct proposal and shared by every ratio and seed."""
        p = plan(self.model, press, self.n)
        if p.kind != "sampling":
            raise ValueError(f"proposals_of needs a SamplingPress with compression_ratio > 0, got {press!r}")
        stored = self._stored(p)
        return {layer.self_attn: stored[layer.self_attn.layer_idx] for layer in self.layers
                if layer.self_attn.layer_idx in stored}

    def take_full(self) -> DynamicCache:
        """The full cache, handed over: this prefill drops its own references to it (and everything
        else it holds), so decoding it frees each layer as it is replaced, whoever still holds this
        object (a press's check of its wrappers snapshots the callers' frames). Nothing can be
        compressed afterwards."""
        cache = self.compress(None)
        self.full_cache = self.keys = self.values = self._eager = None
        self.stored = {}
        return cache

    @torch.no_grad()
    def compress(self, press: BasePress | None) -> DynamicCache:
        """A cache holding what ``press`` would have left after this prefill (None: the full cache).
        Its layers start as the prefill's own tensors, which no press writes into (they gather or
        mask), so nothing is copied. A SamplingPress's correction is on the returned cache, as after
        a real prefill under the press; a masking press's (AdaKV's) masks are on the attention
        modules, as after that press's prefill, until ``Compressed.take`` or the next compress."""
        if self.keys is None:
            raise RuntimeError("this Prefill handed its full cache over (take_full): prefill the example again")
        self._reset_modules()
        p = plan(self.model, press, self.n)
        if p.kind == "prefill":
            return press_prefill(self.model, self.context_ids, press)
        keys_, values_ = self._eager_prefill() if p.kind == "eager" else (self.keys, self.values)
        cache = DynamicCache()
        for keys, values in zip(keys_, values_):  # DynamicCache.update would copy them (torch.cat)
            layer = DynamicLayer()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            cache.layers.append(layer)
        if p.kind == "full":
            return cache
        if p.kind == "kvzip":
            return self._kvzip(press, cache, self._stored(p) if p.key else None)
        if p.kind == "gate":
            press.compress_scores(cache, self._stored(p))
            return cache
        if p.kind == "sampling":
            # a SpanPress reads the prefill's token ids; a replay binds them around evict
            with press.tokens(self.context_ids) if isinstance(press, SpanPress) else nullcontext():
                press.evict(cache, self.proposals_of(press))
            return cache
        replay = ReplayedScores(compression_ratio=press.compression_ratio, scores=self._stored(p))
        if p.kind == "adakv":
            replay = type(press)(press=replay, alpha_safeguard=press.alpha_safeguard)  # masks, or evicts (ragged)
        positions = torch.arange(self.n, device=self.context_ids.device)
        for layer in self.layers:
            module = layer.self_attn
            hidden = torch.empty(1, self.n, 0, device=self.keys[module.layer_idx].device)  # its length only
            replay.forward_hook(module, [], {"hidden_states": hidden, "cache_position": positions,
                                             "past_key_values": cache}, (None, None))
        return cache

    def _kvzip(self, press: KVzipSampledPress, cache: DynamicCache, tails: dict | None) -> DynamicCache:
        """``press`` entered as the kvpress pipeline enters it, its prefill replaced by ``cache`` (the shared
        prefill's tensors: what its own prefill would have left) and its tail proposals by ``tails``: it
        scores (reconstruction passes, or their kept scores) and evicts ``cache`` (``press.compress``)."""
        return press.compress(self.model, cache, self.context_ids, tails)


def cache_summary(cache: DynamicCache, press: BasePress | None, n: int) -> tuple[float, int]:
    """(realised compression ratio, bytes of keys and values held: each storage once, ``cache.held_bytes``)."""
    held = cache_held_bytes(cache)[0]
    if isinstance(press, SamplingPress) and press.stats:  # no stats at ratio 0: nothing was evicted
        return press.stats["realised_ratio"], held
    if isinstance(press, AdaKVPress):  # masks entries, frees nothing
        return press.compression_ratio, held
    stored = sum(mean_kept(layer) for layer in cache.layers)
    return 1.0 - stored / (n * len(cache.layers)), held


def press_record(press: BasePress | None) -> dict:
    """What a record of ``press`` names beyond the press's name, after it compressed: the gate a gate press used."""
    return {"gate": press.gate_used} if isinstance(press, GatePress) else {}


def bias_bytes(cache, layers) -> int:
    """Bytes of the bias a press left on the layers of ``cache`` that the model's ``layers`` read (0 where it
    stored none: ``cache.held_bytes``): the correction bias of a dense layer, a ragged layer's own."""
    return sum(held_bytes(cache.layers[layer.self_attn.layer_idx])[1] for layer in layers)


def drop_masks(module) -> None:
    """Remove a masking press's (kvpress AdaKV's) ``masked_key_indices`` from an attention module,
    if it has one (a module that never had it is left without it)."""
    if "masked_key_indices" in vars(module):
        del module.masked_key_indices
