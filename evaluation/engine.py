"""The one engine for prefill, compress and decode, used by the runner and every benchmark.

Prefill once (``Prefill``): each example's context is prefilled once with the full cache while
every attention layer's hook inputs are recorded. Compress many (``Prefill.compress``): each press
then replays on a copy of that cache, through the presses' public API only: a ``SamplingPress``
through ``propose`` (one proposal per layer, computed once per example and distinct proposal and
shared by every ratio and seed) and ``evict``; a kvpress press through its ``forward_hook``. This is
exactly what the hooks would have seen in a real prefill: compression happens after a layer's
attention, so no layer's input depends on another layer's compression. H2O reads eager attention
weights: one eager prefill per example records each layer's scores (kvpress's own
``ObservedAttentionPress.score``), and every ratio keeps its top-k through ``ReplayedScores``.

Decode batched (``generate_batch``): greedy decoding of a small model on a CPU reads every weight
once per token, whatever the batch, so B configurations of one example decode side by side. Their
caches are stacked along the batch axis, each layer padded to the longest configuration, and
decoded through the correction's biased attention: bias 0 on a top-k cache, the SNIS log-weights on
a sampled one, the dtype's lowest value on padding (exp of it is exactly 0). The arithmetic is the
same up to float rounding, so a greedy near-tie can flip; kvpress's ``generate_answer`` is the
one-at-a-time reference. Presses that mask instead of evicting (AdaKV) decode in the batch with
the lowest bias on their masked entries.

Score teacher-forced (``teacher_forced``): one forward of a known continuation on a compressed
cache, for the fidelity benchmark (logits, and optionally each layer's attention output).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kvpress import AdaKVPress, BasePress, ObservedAttentionPress
from kvpress.presses.scorer_press import ScorerPress
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvpress_prob import SamplingPress, correction
from kvpress_prob.press import language_model
from kvpress_prob.spans import SpanPress


@dataclass
class ReplayedScores(ScorerPress):
    """kvpress's top-k (``ScorerPress.compress``) on scores computed earlier, per layer: how every
    ratio of an H2O press reuses one eager prefill.

    Parameters
    ----------
    compression_ratio : float
        Fraction of key-value pairs removed.
    scores : dict[int, torch.Tensor]
        Layer index -> (b, H_kv, n) scores.
    """

    scores: dict = field(default_factory=dict)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.scores[module.layer_idx]


@torch.no_grad()
def recorded_prefill(model, layers, context_ids: torch.Tensor, on_layer=None) -> tuple[DynamicCache, list]:
    """A full-cache prefill that keeps each attention module's hook inputs (past_key_values
    left out); ``on_layer(module, kwargs, output)`` also sees each layer's hook call."""
    inputs: list[tuple[torch.nn.Module, dict]] = []

    def record(module, args, kwargs, output):
        if on_layer is not None:
            on_layer(module, kwargs, output)
        inputs.append((module, {k: v for k, v in kwargs.items() if k != "past_key_values"}))

    cache = DynamicCache()
    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in layers]
    try:
        model.model(input_ids=context_ids, past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    return cache, inputs


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
    """One full-cache prefill of ``context_ids`` whose layer hooks can be replayed by any press."""

    def __init__(self, model, context_ids: torch.Tensor):
        self.model = model
        self.context_ids = context_ids
        self.layers = language_model(model).layers
        self.proposals: dict[str, dict[int, torch.Tensor]] = {}  # repr(proposal) -> layer index -> pi
        self._eager = None
        self.full_cache, self.inputs = recorded_prefill(model, self.layers, context_ids)  # never modified
        self.keys = [layer.keys for layer in self.full_cache.layers]
        self.values = [layer.values for layer in self.full_cache.layers]

    def _reset_modules(self) -> None:
        # AdaKV's mask lives on the modules; a SamplingPress's correction lives on its own cache
        for layer in self.layers:
            layer.self_attn.masked_key_indices = None

    @torch.no_grad()
    def _eager_prefill(self) -> tuple[list, list, list, dict[int, torch.Tensor]]:
        """H2O reads eager attention weights, and an eager prefill's cache differs from sdpa's in the
        last bits: one eager prefill, kept with its hook inputs and each layer's H2O scores (kvpress's
        own ``ObservedAttentionPress.score``), serves every ratio."""
        if self._eager is None:
            scorer, scores = ObservedAttentionPress(), {}

            def score(module, kwargs, output):
                layer = kwargs["past_key_values"].layers[module.layer_idx]
                scores[module.layer_idx] = scorer.score(
                    module, kwargs["hidden_states"], layer.keys, layer.values, output[1], kwargs)

            previous = self.model.config._attn_implementation
            self.model.set_attn_implementation("eager")
            try:
                cache, inputs = recorded_prefill(self.model, self.layers, self.context_ids, score)
            finally:
                self.model.set_attn_implementation(previous)
            self._eager = ([c.keys for c in cache.layers], [c.values for c in cache.layers], inputs, scores)
        return self._eager

    def source_keys(self, press: BasePress | None) -> list[torch.Tensor]:
        """Each layer's full keys (b, H_kv, n, d) that ``press`` compresses from: the eager
        prefill's for H2O (its keys differ from sdpa's in the last bits), else the sdpa prefill's."""
        return self._eager_prefill()[0] if isinstance(press, ObservedAttentionPress) else self.keys

    @torch.no_grad()
    def proposals_of(self, press: SamplingPress) -> dict[torch.nn.Module, torch.Tensor]:
        """Each attention module's proposal (b, H_kv, n) for ``press``, computed once per example and
        distinct proposal (``press.propose`` on the recorded inputs) and shared by every ratio and seed."""
        press.post_init_from_model(self.model)
        memo = self.proposals.setdefault(repr(press.proposal), {})  # after post_init: a scorer's ratio is in it
        proposals = {}
        for module, kwargs in self.inputs:
            if module.layer_idx not in memo:  # proposals only read the cache
                memo[module.layer_idx] = press.propose(module, {**kwargs, "past_key_values": self.full_cache})
            proposals[module] = memo[module.layer_idx]
        return proposals

    @torch.no_grad()
    def compress(self, press: BasePress | None) -> DynamicCache:
        """A fresh cache holding what ``press`` would have left after this prefill (None: the full
        cache). A SamplingPress's correction is left on the attention modules, as after a real
        prefill under the press."""
        self._reset_modules()
        keys_, values_, inputs = self.keys, self.values, self.inputs
        if isinstance(press, ObservedAttentionPress):
            keys_, values_, inputs, scores = self._eager_prefill()
            press = ReplayedScores(compression_ratio=press.compression_ratio, scores=scores)
        cache = DynamicCache()
        for layer_idx, (keys, values) in enumerate(zip(keys_, values_)):
            cache.update(keys.clone(), values.clone(), layer_idx)
        if press is None:
            return cache
        press.post_init_from_model(self.model)
        rotary = language_model(self.model).rotary_emb
        for module, _ in inputs:  # as kvpress's BasePress.__call__ does (ExpectedAttention's scorer reads it)
            module.rotary_emb = rotary
        if isinstance(press, SamplingPress):
            if press.compression_ratio > 0:
                # a SpanPress reads the prefill's token ids; a replay binds them around evict
                with press.tokens(self.context_ids) if isinstance(press, SpanPress) else nullcontext():
                    press.evict(cache, self.proposals_of(press))
            return cache
        for module, kwargs in inputs:
            press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, (None, None))
        return cache


@dataclass
class Compressed:
    """One configuration's compressed cache, detached from the model: per layer (1, H_kv, S_l, d)
    keys and values and the (1, H_kv, S_l) correction bias (None: plain attention)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    bias: list[torch.Tensor | None]

    @classmethod
    def take(cls, cache: DynamicCache, layers) -> Compressed:
        """Detach ``cache`` and the modules' correction bias. A press that masks keys instead of
        evicting them (kvpress's AdaKV: ``masked_key_indices``, whose fake keys give those entries
        an attention weight of exactly 0) becomes the dtype's lowest bias on the masked entries."""
        biases = []
        for layer, cache_layer in zip(layers, cache.layers):
            bias, masked = correction.bias_of(layer.self_attn, cache), getattr(layer.self_attn, "masked_key_indices", None)
            if masked is not None:
                keys = cache_layer.keys  # (b, H_kv, n, d)
                bias = torch.zeros(keys.shape[:3], dtype=keys.dtype, device=keys.device)
                bias[masked[0], masked[1], masked[2]] = torch.finfo(keys.dtype).min
            biases.append(bias)
        return cls([c.keys for c in cache.layers], [c.values for c in cache.layers], biases)


class RoomyLayer(DynamicLayer):
    """A DynamicLayer that writes new tokens into preallocated room instead of concatenating:
    DynamicLayer copies the whole cache at every decoding step, which dominates a batched decode."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        b, h, s, d = keys.shape
        self._keys = keys.new_empty(b, h, s + room, d)  # (B, H_kv, S + room, d)
        self._values = values.new_empty(b, h, s + room, values.shape[-1])
        self._keys[:, :, :s], self._values[:, :, :s] = keys, values
        self.keys, self.values = self._keys[:, :, :s], self._values[:, :, :s]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, cache_kwargs=None):
        s, q = self.keys.shape[2], key_states.shape[2]
        if s + q > self._keys.shape[2]:
            raise RuntimeError(f"RoomyLayer holds {self._keys.shape[2]} entries, {s + q} requested")
        self._keys[:, :, s : s + q], self._values[:, :, s : s + q] = key_states, value_states
        self.keys, self.values = self._keys[:, :, : s + q], self._values[:, :, : s + q]
        return self.keys, self.values

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows."""
        s = self.keys.shape[2]
        self._keys, self._values = self._keys[rows], self._values[rows]
        self.keys, self.values = self._keys[:, :, :s], self._values[:, :, :s]


def stack(items: list[Compressed], room: int) -> tuple[DynamicCache, list[torch.Tensor]]:
    """One batched cache of B configurations, with room for ``room`` new tokens, and its
    per-layer (B, H_kv, S_max) bias."""
    cache, biases = DynamicCache(), []
    for layer in range(len(items[0].keys)):
        s_max = max(item.keys[layer].shape[2] for item in items)
        keys, values, bias = [], [], []
        for item in items:
            k, v, b = item.keys[layer], item.values[layer], item.bias[layer]
            pad = s_max - k.shape[2]
            lowest = torch.finfo(k.dtype).min
            b = torch.zeros(k.shape[:3], dtype=k.dtype, device=k.device) if b is None else b.to(k.dtype)
            keys.append(F.pad(k, (0, 0, 0, pad)))  # (1, H_kv, S_max, d)
            values.append(F.pad(v, (0, 0, 0, pad)))
            bias.append(F.pad(b, (0, pad), value=lowest))  # (1, H_kv, S_max)
        cache.layers.append(RoomyLayer(torch.cat(keys), torch.cat(values), room))
        biases.append(torch.cat(bias))
    return cache, biases


@torch.no_grad()
def generate_batch(model, tokenizer, question_ids: torch.Tensor, items: list[Compressed], context_length: int,
                   max_new_tokens: int) -> list[str]:
    """kvpress's ``generate_answer`` for B compressed caches at once (greedy, same stopping rule:
    the first token is never checked, a later stop token ends that row and is kept, then skipped
    by ``skip_special_tokens``). Finished rows leave the batch once a quarter of it is done, so
    one long answer does not keep every short one decoding."""
    layers = language_model(model).layers
    cache, biases = stack(items, room=question_ids.shape[1] + max_new_tokens)
    b, device = len(items), question_ids.device
    stop = model.generation_config.eos_token_id
    stop_ids = set(stop if isinstance(stop, list) else [stop])
    stop = torch.tensor(sorted(stop_ids), device=device)
    rows: list[list[int]] = [[] for _ in range(b)]
    active = torch.arange(b, device=device)  # which of the B rows are still in the batch
    try:
        for layer, bias in zip(layers, biases):
            correction.set_bias(layer.self_attn, bias, cache)
            layer.self_attn.masked_key_indices = None
        q_len = question_ids.shape[1]
        position_ids = torch.arange(context_length, context_length + q_len, device=device)
        logits = model(input_ids=question_ids.expand(b, q_len), past_key_values=cache,
                       position_ids=position_ids.expand(b, q_len), logits_to_keep=1).logits
        new = logits[:, -1].argmax(-1)  # (B_active,)
        position = context_length + q_len
        for i in range(max_new_tokens):
            for row, token in zip(active.tolist(), new.tolist()):
                rows[row].append(token)
            if i == max_new_tokens - 1:
                break
            done = torch.isin(new, stop) if i > 0 else torch.zeros_like(new, dtype=torch.bool)
            if done.all():
                break
            if int(done.sum()) >= max(1, len(active) // 4):  # drop finished rows
                keep = (~done).nonzero().squeeze(1)
                for layer, cache_layer in zip(layers, cache.layers):
                    cache_layer.select(keep)
                    correction.set_bias(layer.self_attn, correction.bias_of(layer.self_attn, cache)[keep], cache)
                active, new = active[keep], new[keep]
            position_ids = torch.full((len(active), 1), position + i, device=device)
            logits = model(input_ids=new[:, None], past_key_values=cache, position_ids=position_ids).logits
            new = logits[:, -1].argmax(-1)
    finally:
        for layer in layers:
            correction.reset(layer.self_attn)
    answers = []
    for row in rows:
        end = next((t + 1 for t in range(1, len(row)) if row[t] in stop_ids), len(row))
        answers.append(str(tokenizer.decode(row[:end], skip_special_tokens=True)))
    return answers


def cache_summary(cache: DynamicCache, press: BasePress | None, n: int) -> tuple[float, int]:
    """(realised compression ratio, bytes of keys and values held)."""
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    if isinstance(press, SamplingPress) and press.stats:  # no stats at ratio 0: nothing was evicted
        return press.stats["realised_ratio"], held
    if isinstance(press, AdaKVPress):  # masks entries, frees nothing
        return press.compression_ratio, held
    stored = sum(layer.keys.shape[2] for layer in cache.layers)
    return 1.0 - stored / (n * len(cache.layers)), held


@torch.no_grad()
def teacher_forced(model, cache: DynamicCache, continuation_ids: torch.Tensor, n_context: int,
                   capture_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of ``continuation_ids`` (1, T) on ``cache`` (extended in place), positions from
    ``n_context`` as the pipeline decodes. Returns (logits (T, V) float32, each layer's attention
    output (L, T, hidden) float32, or None)."""
    outputs: dict[int, torch.Tensor] = {}

    def hook(module, args, output):
        outputs[module.layer_idx] = output[0][0].detach().float().clone()

    modules = [layer.self_attn for layer in language_model(model).layers]
    handles = [m.register_forward_hook(hook) for m in modules] if capture_attention else []
    t = continuation_ids.shape[1]
    position_ids = torch.arange(n_context, n_context + t, device=continuation_ids.device)[None]
    try:
        out = model(input_ids=continuation_ids, past_key_values=cache, position_ids=position_ids)
    finally:
        for handle in handles:
            handle.remove()
    attention = torch.stack([outputs[i] for i in range(len(modules))]) if capture_attention else None
    return out.logits[0].float(), attention
