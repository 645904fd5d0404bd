"""The sweep: every (press, compression ratio, seed) configuration on every example.

Shared prefill: each example's context is prefilled once with the full cache while every
attention layer's hook inputs are recorded; each configuration then replays its press's hooks
on a copy of that cache (exactly what the hooks would have seen: compression happens after a
layer's attention, so no layer's input depends on another layer's compression) and decodes
with the kvpress pipeline's own ``generate_answer``. Presses that need another forward (H2O on
eager attention) are run from scratch. This is the only module that touches the model and disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch
from kvpress import AdaKVPress, BasePress, KVPressTextGenerationPipeline
from tqdm.auto import tqdm
from transformers import DynamicCache

from evaluation.metrics import score_example
from evaluation.store import ResultStore, record_key, shard
from kvpress_prob import correction
from kvpress_prob.press import SamplingPress, language_model
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


class SharedPrefill:
    """One full-cache prefill of ``context_ids`` whose layer hooks can be replayed by any press."""

    def __init__(self, model, context_ids: torch.Tensor):
        self.model = model
        self.context_ids = context_ids
        self.layers = language_model(model).layers
        self.inputs: list[tuple[torch.nn.Module, dict]] = []

        def record(module, args, kwargs, output):
            self.inputs.append((module, {k: v for k, v in kwargs.items() if k != "past_key_values"}))

        cache = DynamicCache()
        hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in self.layers]
        try:
            with torch.no_grad():
                model.model(input_ids=context_ids, past_key_values=cache)
        finally:
            for hook in hooks:
                hook.remove()
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]

    def _reset_modules(self) -> None:
        for layer in self.layers:
            correction.reset(layer.self_attn)
            layer.self_attn.masked_key_indices = None

    @torch.no_grad()
    def compressed_cache(self, press: BasePress | None) -> DynamicCache:
        """A fresh cache holding what ``press`` would have left after this prefill."""
        self._reset_modules()
        if isinstance(press, EagerObservedAttentionPress):  # needs eager attention weights: run it
            cache = DynamicCache()
            with press(self.model):
                self.model.model(input_ids=self.context_ids, past_key_values=cache)
            return cache
        cache = DynamicCache()
        for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys.clone(), values.clone(), layer_idx)
        if press is None:
            return cache
        press.post_init_from_model(self.model)
        rotary = language_model(self.model).rotary_emb
        for module, kwargs in self.inputs:
            module.rotary_emb = rotary
            press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, (None, None))
        if isinstance(press, SamplingPress):
            press.evict()
        return cache


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
    progress: bool = True,
) -> int:
    """Run every configuration on every example of this shard not yet in ``store``.

    Each finished (example, configuration) is appended to the store at once, so a killed run
    loses at most the configuration in flight. Returns the number of results written.
    """
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
        for cfg in cfgs:
            start = time.perf_counter()
            press = cfg.build()
            cache = shared.compressed_cache(press)
            realised, held = cache_summary(cache, press, n)
            prediction = pipe.generate_answer(question_ids, cache, n, int(row["max_new_tokens"]))
            answer = list(row["answer"])
            store.append([dict(
                model=model_name, dataset=dataset, data_dir=data_dir, task=row["task"],
                example_id=row["example_id"], press=cfg.press, compression_ratio=cfg.compression_ratio,
                seed=cfg.seed, prediction=prediction, answer=answer,
                score=score_example(row["task"], prediction, answer), realised_ratio=realised, kv_bytes=held,
                seconds=time.perf_counter() - start,
            )])
            written += 1
            bar.update(1)
        del shared
    bar.close()
    return written
