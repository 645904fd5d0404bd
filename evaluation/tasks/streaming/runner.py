"""The resumable streaming sweep: one record per (stream, setting, press, seed) in a ``ResultStore``.

A setting is (budget, chunk, interval) on streams of ``n`` tokens; its records carry it as
``data_dir = "n<n>-b<budget>-c<chunk>-i<interval>"`` (with the split in ``dataset = "stream-<split>"``),
so the store's work-unit key (model, dataset, data_dir, example_id = stream, press, seed) tells the
units apart. For each stream and setting with work left, the full cache is fed once by the same
schedule, then every pending press; each finished unit is appended at once, so a killed run loses only
the unit in flight. Record fields beside the key: task ("stream"), split, n_tokens, budget, chunk,
interval, score_from, n_scored, nll_full, nll, nll_increase, kl (means over the scored tokens, nats),
held_max, attended_max, held_end (entries per KV head), kv_bytes (keys and values of the final cache),
bias_bytes (the correction bias a press keeps beside them, measured on the cache), budget_bytes (keys and values
of `budget` entries per KV head in every layer: the equal-bytes target), seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from evaluation.store.results import ResultStore, record_key
from evaluation.tasks.streaming import metrics
from evaluation.tasks.streaming.drive import Schedule, feed, full_logits
from evaluation.tasks.streaming.presses import samples, stream_presses
from evaluation.tasks.streaming.streams import Stream


@dataclass(frozen=True)
class Unit:
    """One press at one seed in one setting."""

    press: str
    seed: int
    budget: int
    chunk: int
    interval: int

    def schedule(self, n: int) -> Schedule:
        return Schedule(n=n, budget=self.budget, chunk=self.chunk, interval=self.interval)

    def data_dir(self, n: int) -> str:
        return f"n{n}-b{self.budget}-c{self.chunk}-i{self.interval}"


def units(presses: list[str], seeds: list[int], budgets: list[int], chunks: list[int], intervals: list[int]) -> list[Unit]:
    """Every (press, seed, budget, chunk, interval); a deterministic press runs with the first seed only.
    An unknown press name raises ValueError listing the known ones."""
    known = stream_presses()
    unknown = [p for p in presses if p not in known]
    if unknown:
        raise ValueError(f"unknown press(es) {unknown}; --presses accepts: {', '.join(known)}")
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    return [Unit(p, int(s), b, c, i) for b in budgets for c in chunks for i in intervals for p in presses
            for s in (seeds if samples(p) else seeds[:1])]


def key(unit: Unit, stream_id: str, n: int, *, model_name: str, split: str) -> tuple:
    return record_key(dict(model=model_name, dataset=f"stream-{split}", data_dir=unit.data_dir(n),
                           example_id=stream_id, press=unit.press, compression_ratio=None, seed=unit.seed))


def run_unit(model, stream: Stream, unit: Unit, reference: torch.Tensor) -> dict:
    """Feed ``stream`` under the unit's press, scored against ``reference`` (``full_logits``)."""
    schedule = unit.schedule(stream.ids.shape[1])
    targets = stream.ids[0].to(reference.device)
    parts = []

    def score(start: int, logits: torch.Tensor) -> None:
        offset = start - schedule.score_from
        rows = slice(offset, offset + len(logits))
        parts.append(metrics.token_scores(reference[rows], logits, targets[start + 1:start + 1 + len(logits)]))

    torch.manual_seed(unit.seed)
    press = stream_presses()[unit.press](schedule, unit.seed, head_dim(model), model.dtype)
    sizes = feed(model, stream.ids, schedule, press, score)
    del sizes["cache"]
    return metrics.summary(parts) | sizes


def head_dim(model) -> int:
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def run(model, streams: list[Stream], todo: list[Unit], store: ResultStore, *, model_name: str, split: str,
        progress: bool = True) -> int:
    """Run every unit on every stream not yet in ``store``; returns the number of records written."""
    done = store.done_keys()
    pending = [(s, u) for s in streams for u in todo
               if key(u, s.stream_id, s.ids.shape[1], model_name=model_name, split=split) not in done]
    bar = tqdm(total=len(pending), desc=f"stream-{split}", disable=not progress)
    written = 0
    for stream in streams:
        n = stream.ids.shape[1]
        mine = [u for s, u in pending if s is stream]
        for setting in dict.fromkeys((u.budget, u.chunk, u.interval) for u in mine):
            reference = full_logits(model, stream.ids, Schedule(n, *setting))
            for unit in [u for u in mine if (u.budget, u.chunk, u.interval) == setting]:
                start = time.perf_counter()
                result = run_unit(model, stream, unit, reference)
                store.append([dict(
                    model=model_name, dataset=f"stream-{split}", data_dir=unit.data_dir(n), task="stream",
                    example_id=stream.stream_id, press=unit.press, compression_ratio=None, seed=unit.seed,
                    split=split, n_tokens=n, budget=unit.budget, chunk=unit.chunk, interval=unit.interval,
                    score_from=unit.schedule(n).score_from, **result, seconds=time.perf_counter() - start)])
                written += 1
                bar.update(1)
            del reference
    bar.close()
    return written
