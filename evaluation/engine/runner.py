"""The sweep: every (press, compression ratio, seed) configuration on every example.

Each example is prefilled once, every configuration compresses a copy of that prefill and the
configurations of one example decode together, all through ``evaluation.engine``. Results are
appended to the store one (example, configuration) at a time. This is the only module of the
harness that touches the model and the disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from kvpress import BasePress, KVPressTextGenerationPipeline
from tqdm.auto import tqdm

from evaluation.engine import Compressed, Prefill, bias_bytes, cache_summary, generate_batch, sizing
from evaluation.engine.prefill import press_record
from evaluation.metrics.answers import score_example
from evaluation.store.results import ResultStore, record_key, shard
from kvpress_prob.names.registry import get_press, is_sampling

REFERENCE = "full"


@dataclass(frozen=True)
class Config:
    """One configuration of a sweep: a registry press, its ratio, its seed, and field overrides
    passed to ``get_press`` (e.g. ``(("budget", "head"), ("sampler", "topk"))``)."""

    press: str
    compression_ratio: float
    seed: int = 0
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """The name results are stored under: the press, then its overrides in brackets."""
        if not self.overrides:
            return self.press
        return f"{self.press}[{','.join(f'{k}={v}' for k, v in self.overrides)}]"

    @property
    def samples(self) -> bool:
        """Whether the result depends on the seed."""
        return self.press != REFERENCE and is_sampling(self.press, **dict(self.overrides))

    def build(self) -> BasePress | None:
        if self.press == REFERENCE:
            return None
        overrides = dict(self.overrides) | ({"seed": self.seed} if self.samples else {})
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


@torch.no_grad()  # kvpress's generate_answer, called outside its pipeline, would otherwise record autograd graphs
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
    decode_batch: int | str = 1,
    progress: bool = True,
    free_memory=None,
) -> int:
    """Run every configuration on every example of this shard not yet in ``store``.

    Each finished (example, configuration) is appended to the store at once, so a killed run
    loses at most the ``decode_batch`` configurations in flight. Returns the number of results written.
    ``decode_batch="auto"`` sizes each batch from the free device memory (``engine.sizing``;
    ``free_memory(device)`` measures it, default ``sizing.free_bytes``).
    """
    if decode_batch != "auto" and not (isinstance(decode_batch, int) and decode_batch >= 1):
        raise ValueError(f"decode_batch must be >= 1 or 'auto', got {decode_batch!r}")
    free_memory = free_memory or sizing.free_bytes
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    done = store.done_keys()
    rows = shard([row for _, row in examples.iterrows()], shard_spec, key=lambda row: row["example_id"])

    def key(row, cfg):
        return record_key(dict(model=model_name, dataset=dataset, data_dir=data_dir, example_id=row["example_id"],
                               press=cfg.label, compression_ratio=cfg.compression_ratio, seed=cfg.seed))

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
        shared = Prefill(model, context_ids, [cfg.build() for cfg in cfgs])  # one prefill for every configuration
        answer = list(row["answer"])
        pending: list[tuple[Config, Compressed, float, int, float]] = []
        full = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(shared.keys, shared.values))
        sizer = sizing.BatchSizer(decode_batch, free_memory(model.device), full,
                                  question_ids.shape[1] + int(row["max_new_tokens"]), model.config.vocab_size)

        def record(cfg, prediction, realised, held, seconds):
            store.append([dict(
                model=model_name, dataset=dataset, data_dir=data_dir, task=row["task"],
                example_id=row["example_id"], press=cfg.label, compression_ratio=cfg.compression_ratio,
                seed=cfg.seed, prediction=prediction, answer=answer,
                score=score_example(row["task"], prediction, answer), realised_ratio=realised, kv_bytes=held[0],
                bias_bytes=held[1], seconds=seconds, **held[2],
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

        for cfg in [cfg for cfg in cfgs if cfg.press != REFERENCE]:
            start = time.perf_counter()
            if decode_batch == 1:
                cache, realised, held = _compressed(shared, cfg, n)
                prediction = pipe.generate_answer(question_ids, cache, n, int(row["max_new_tokens"]))
                del cache
                record(cfg, prediction, realised, held, time.perf_counter() - start)
            else:
                item = (cfg, *_compressed(shared, cfg, n, take=True), time.perf_counter() - start)
                if not sizer.fits([p[1] for p in pending], item[1]):
                    flush()
                pending.append(item)
                if sizer.full(pending):
                    flush()
            written += 1
        if pending:
            flush()
        for cfg in [cfg for cfg in cfgs if cfg.press == REFERENCE]:  # last, alone: nothing padded to full length
            start = time.perf_counter()
            cache = shared.take_full()  # the prefill's only copy, which decoding replaces layer by layer
            realised, held = cache_summary(cache, None, n)
            held = (held, 0, {})
            prediction = pipe.generate_answer(question_ids, cache, n, int(row["max_new_tokens"]))
            del cache
            record(cfg, prediction, realised, held, time.perf_counter() - start)
            written += 1
        del shared
    bar.close()
    return written


def _compressed(shared: Prefill, cfg: Config, n: int, take: bool = False) -> tuple[Any, float, tuple[int, int, dict]]:
    """(the compressed cache, or its ``Compressed`` item, realised ratio, (K+V bytes, bias bytes held, what the
    record names beyond the press: ``press_record``)). Its own frame: nothing of it outlives the call but what it
    returns."""
    press = cfg.build()
    cache = shared.compress(press)
    realised, held = cache_summary(cache, press, n)
    held = (held, bias_bytes(cache, shared.layers), press_record(press))  # before take(): a mask as a bias is not held
    return (Compressed.take(cache, shared.layers) if take else cache), realised, held
