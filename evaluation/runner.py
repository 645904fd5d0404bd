"""The sweep: every (press, compression ratio, seed) configuration on every example.

Shared prefill: each example's context is prefilled once with the full cache while every
attention layer's hook inputs are recorded; each configuration then replays its press's hooks
on a copy of that cache (exactly what the hooks would have seen: compression happens after a
layer's attention, so no layer's input depends on another layer's compression) and decodes
with the kvpress pipeline's own ``generate_answer``. Presses that need another forward (H2O on
eager attention) are run from scratch. This is the only module that touches the model and disk.

Batched decoding (``decode_batch`` > 1): greedy decoding of a 135M model on a CPU reads every
weight once per token, whatever the batch, so decoding B configurations of one example side by
side costs little more than one. Their caches are stacked along the batch axis, each layer padded
to the longest configuration, and decoded through the correction's biased attention: bias 0 on a
top-k cache, the SNIS log-weights on a sampled one, the dtype's lowest value on padding (exp of it
is exactly 0). The arithmetic is the same up to float rounding (the batched matrix products
associate sums differently), so a greedy near-tie can flip; ``decode_batch=1`` is the pipeline's
own decoding, token for token. Presses that mask instead of evicting (AdaKV) decode alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from kvpress import AdaKVPress, BasePress, KVPressTextGenerationPipeline, ObservedAttentionPress
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from evaluation.metrics import score_example
from evaluation.store import ResultStore, record_key, shard
from kvpress_prob import correction
from kvpress_prob.press import SamplingPress, language_model
from kvpress_prob.proposals import Proposal, ScoreProposal
from kvpress_prob.registry import EagerObservedAttentionPress, get_press, is_sampling

REFERENCE = "full"


@dataclass(frozen=True)
class Config:
    """One configuration of the sweep."""

    press: str
    compression_ratio: float
    seed: int = 0

    def build(self) -> BasePress | None:
        if self.press == REFERENCE:
            return None
        overrides = {"seed": self.seed} if is_sampling(self.press) else {}
        return get_press(self.press, self.compression_ratio, **overrides)


def configurations(presses: list[str], ratios: list[float], seeds: list[int]) -> list[Config]:
    """The full-cache reference once, deterministic presses once per ratio, sampling ones per seed."""
    configs = [Config(REFERENCE, 0.0, 0)]
    for name in presses:
        get_press(name, 0.5)  # fails fast on an unknown name, listing the valid ones
        for ratio in ratios:
            for seed in seeds if is_sampling(name) else seeds[:1]:
                configs.append(Config(name, float(ratio), int(seed)))
    return configs


class Remembered(Proposal):
    """A proposal computed once per layer of a prefill and handed to every ratio and seed of the
    same press. Attention-based proposals (pi_min, H2O) read only the prefill, so this is exact;
    ScoreProposal is not remembered (a kvpress scorer may read its compression_ratio)."""

    def __init__(self, proposal: Proposal, memo: dict[int, torch.Tensor]):
        self.proposal, self.memo = proposal, memo

    def __call__(self, module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        if module.layer_idx not in self.memo:
            self.memo[module.layer_idx] = self.proposal(module, hidden_states, keys, values, kwargs)
        return self.memo[module.layer_idx]


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


class SharedPrefill:
    """One full-cache prefill of ``context_ids`` whose layer hooks can be replayed by any press."""

    def __init__(self, model, context_ids: torch.Tensor):
        self.model = model
        self.context_ids = context_ids
        self.layers = language_model(model).layers
        self.proposals: dict[str, dict[int, torch.Tensor]] = {}  # repr(proposal) -> layer -> pi
        self._eager = None
        cache, self.inputs = recorded_prefill(model, self.layers, context_ids)
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]

    def _reset_modules(self) -> None:
        for layer in self.layers:
            correction.reset(layer.self_attn)
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

    @torch.no_grad()
    def compressed_cache(self, press: BasePress | None) -> DynamicCache:
        """A fresh cache holding what ``press`` would have left after this prefill."""
        self._reset_modules()
        keys_, values_, inputs = self.keys, self.values, self.inputs
        if isinstance(press, EagerObservedAttentionPress):
            keys_, values_, inputs, scores = self._eager_prefill()
            press.score = lambda module, *args: scores[module.layer_idx]
        cache = DynamicCache()
        for layer_idx, (keys, values) in enumerate(zip(keys_, values_)):
            cache.update(keys.clone(), values.clone(), layer_idx)
        if press is None:
            return cache
        press.post_init_from_model(self.model)
        if isinstance(press, SamplingPress) and not isinstance(press.proposal, ScoreProposal):
            press.proposal = Remembered(press.proposal, self.proposals.setdefault(repr(press.proposal), {}))
        rotary = language_model(self.model).rotary_emb
        for module, kwargs in inputs:
            module.rotary_emb = rotary
            press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, (None, None))
        if isinstance(press, SamplingPress):
            press.evict()
        return cache


@dataclass
class Compressed:
    """One configuration's compressed cache, detached from the model: per layer (1, H_kv, S_l, d)
    keys and values and the (1, H_kv, S_l) correction bias (None: plain attention)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    bias: list[torch.Tensor | None]

    @classmethod
    def take(cls, cache: DynamicCache, layers) -> Compressed | None:
        """Detach ``cache`` and the modules' correction bias; None if the press masks keys (AdaKV)."""
        if any(getattr(layer.self_attn, "masked_key_indices", None) is not None for layer in layers):
            return None
        return cls([c.keys for c in cache.layers], [c.values for c in cache.layers],
                   [getattr(layer.self_attn, correction.BIAS_ATTR, None) for layer in layers])


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
            setattr(layer.self_attn, correction.BIAS_ATTR, bias)
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
                    bias = getattr(layer.self_attn, correction.BIAS_ATTR)
                    setattr(layer.self_attn, correction.BIAS_ATTR, bias[keep])
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
    if isinstance(press, SamplingPress):
        return press.stats["realised_ratio"], held
    if isinstance(press, AdaKVPress):  # masks entries, frees nothing
        return press.compression_ratio, held
    stored = sum(layer.keys.shape[2] for layer in cache.layers)
    return 1.0 - stored / (n * len(cache.layers)), held


def run(
    model,
    tokenizer,
    examples: pd.DataFrame,
    configs: list[Config],
    store: ResultStore,
    *,
    model_name: str,
    dataset: str,
    data_dir: str,
    query_aware: bool = False,
    shard_spec: str | None = None,
    decode_batch: int = 1,
    progress: bool = True,
) -> int:
    """Run every configuration on every example of this shard not yet in ``store``.

    Each finished (example, configuration) is appended to the store at once, so a killed run
    loses at most the ``decode_batch`` configurations in flight. Returns the number of results written.
    """
    if decode_batch < 1:
        raise ValueError(f"decode_batch must be >= 1, got {decode_batch}")
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    done = store.done_keys()
    rows = shard([row for _, row in examples.iterrows()], shard_spec, key=lambda row: row["example_id"])

    def key(row, cfg):
        return record_key(dict(model=model_name, dataset=dataset, data_dir=data_dir, example_id=row["example_id"],
                               press=cfg.press, compression_ratio=cfg.compression_ratio, seed=cfg.seed))

    todo = [(row, [cfg for cfg in configs if key(row, cfg) not in done]) for row in rows]
    todo = [(row, cfgs) for row, cfgs in todo if cfgs]
    bar = tqdm(total=sum(len(c) for _, c in todo), desc=f"{dataset}/{data_dir}", disable=not progress)
    written = 0
    for row, cfgs in todo:
        context, question = row["context"], row["question"]
        if query_aware:
            context, question = context + question, ""
        inputs = pipe.preprocess(context, [question], row["answer_prefix"], max_context_length=10**9)
        context_ids = inputs["context_ids"].to(model.device)
        question_ids = inputs["questions_ids"][0].to(model.device)
        n = context_ids.shape[1]
        shared = SharedPrefill(model, context_ids)
        answer = list(row["answer"])
        pending: list[tuple[Config, Compressed, float, int, float]] = []

        def record(cfg, prediction, realised, held, seconds):
            store.append([dict(
                model=model_name, dataset=dataset, data_dir=data_dir, task=row["task"],
                example_id=row["example_id"], press=cfg.press, compression_ratio=cfg.compression_ratio,
                seed=cfg.seed, prediction=prediction, answer=answer,
                score=score_example(row["task"], prediction, answer), realised_ratio=realised, kv_bytes=held,
                seconds=seconds,
            )])
            bar.update(1)

        def flush():
            start = time.perf_counter()
            items = [item for _, item, *_ in pending]
            predictions = generate_batch(model, tokenizer, question_ids, items, n, int(row["max_new_tokens"]))
            share = (time.perf_counter() - start) / len(pending)
            for (cfg, _, realised, held, seconds), prediction in zip(pending, predictions):
                record(cfg, prediction, realised, held, seconds + share)
            pending.clear()

        for cfg in cfgs:
            start = time.perf_counter()
            press = cfg.build()
            cache = shared.compressed_cache(press)
            realised, held = cache_summary(cache, press, n)
            item = Compressed.take(cache, shared.layers) if decode_batch > 1 else None
            if item is None:
                prediction = pipe.generate_answer(question_ids, cache, n, int(row["max_new_tokens"]))
                record(cfg, prediction, realised, held, time.perf_counter() - start)
            else:
                pending.append((cfg, item, realised, held, time.perf_counter() - start))
                if len(pending) == decode_batch:
                    flush()
            written += 1
        if pending:
            flush()
        del shared
    bar.close()
    return written
