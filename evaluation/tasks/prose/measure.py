"""The prose run: every configuration on every window not yet in the store, one record at a time.

A window is prefilled once for every press, ratio and seed (``Prefill``, told the presses it will
serve, so each proposal and scorer is computed once per window); the full cache's logits on the
continuation are the reference; each configuration compresses the prefill, is scored teacher-forced,
and its record is appended at once (a killed run loses at most the configuration in flight).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from evaluation.engine import Compressed, Prefill, bias_bytes, cache_summary, teacher_forced
from evaluation.engine.prefill import press_record
from evaluation.engine.runner import Config
from evaluation.metrics.continuation import kl_per_position, nll_per_position
from evaluation.store.results import ResultStore, record_key
from evaluation.tasks.prose import DATASET
from evaluation.tasks.prose.essays import Window
from kvpress_prob.correction import bias as correction

logger = logging.getLogger("evaluation.tasks.prose")


def window_metrics(reference_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """One configuration on one window, from the (T, V) logits of the full cache and of the press and
    the (T,) targets: mean KL(full || press) per token, mean NLL per token of each, their difference,
    and the fraction of positions whose argmax agrees."""
    kl = kl_per_position(reference_logits, logits)
    nll, nll_full = nll_per_position(logits, targets), nll_per_position(reference_logits, targets)
    return {"kl": float(kl.mean()), "nll": float(nll.mean()), "nll_full": float(nll_full.mean()),
            "nll_delta": float((nll - nll_full).mean()),
            "top1": float((logits.argmax(-1) == reference_logits.argmax(-1)).double().mean())}


def order(windows: list[Window], max_windows: int | None = None) -> list[Window]:
    """The windows in the order a run takes them: every essay's first window, then every essay's
    second, ... (so ``max_windows`` spreads over the essays), cut at ``max_windows`` (None: all)."""
    ranked = sorted(windows, key=lambda w: (w.index, w.essay))
    return ranked if max_windows is None else ranked[:max_windows]


def context_length(window: Window, scored_tokens: int) -> int:
    """The context tokens n of a prose window: all but the ``scored_tokens`` continuation tokens and the
    last target."""
    n = window.ids.shape[1] - scored_tokens - 1
    if n < 1:
        raise ValueError(f"window {window.window_id} holds {window.ids.shape[1]} tokens, fewer than "
                         f"scored_tokens + 2 = {scored_tokens + 2}")
    return n


def masks_as_bias(cache, layers) -> bool:
    """Turn kvpress AdaKV's masks into the correction's bias, in place; True if there were any.

    AdaKV keeps every entry and masks some (``masked_key_indices`` on the modules); at each later
    forward kvpress searches a fake key whose dot product with every query is hugely negative. For a
    continuation of T queries at once such a key need not exist (kvpress raises "Could not find fake
    keys"; it does on a tiny random model) and the search is slow. The dtype's lowest bias on the
    masked entries (``Compressed.take``, as batched decoding does) gives them the same weight, 0."""
    if all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in layers):
        return False
    for layer, bias in zip(layers, Compressed.take(cache, layers).bias):
        layer.self_attn.masked_key_indices = None
        correction.set_bias(layer.self_attn, bias, cache)
    return True


def pending(windows: list, contexts: list[int], configs: list[Config], store: ResultStore, *, dataset: str,
            model_name: str) -> list[tuple]:
    """(window, n, the fields that key its records, its configurations not yet in ``store``) for every
    window with any left, in the order of ``windows``; ``contexts`` holds each window's context length n
    (the records' data_dir). Prose and recall alike."""
    done = store.done_keys()
    todo = []
    for w, n in zip(windows, contexts, strict=True):
        base = dict(model=model_name, dataset=dataset, data_dir=str(n), example_id=w.window_id)
        cfgs = [c for c in configs if record_key(base | dict(press=c.label, compression_ratio=c.compression_ratio,
                                                              seed=c.seed)) not in done]
        if cfgs:
            todo.append((w, n, base, cfgs))
    return todo


@contextmanager
def compressed(shared: Prefill, cfg: Config, n: int):
    """``cfg``'s press on the shared prefill of ``n`` context tokens: yields (the compressed cache, the
    bytes it holds: realised_ratio, kv_bytes, bias_bytes) with kvpress AdaKV's masks turned into the
    correction's bias (``masks_as_bias``) until the block ends. Prose and recall alike."""
    press = cfg.build()
    cache = shared.compress(press)
    realised, held = cache_summary(cache, press, n)
    memory = dict(realised_ratio=realised, kv_bytes=held, bias_bytes=bias_bytes(cache, shared.layers),
                  **press_record(press))
    masked = masks_as_bias(cache, shared.layers)  # after bias_bytes: a mask is not held beside the cache
    try:
        yield cache, memory
    finally:
        if masked:
            for layer in shared.layers:
                correction.reset(layer.self_attn)


@torch.no_grad()
def run(model, tokenizer, windows: list[Window], configs: list[Config], store: ResultStore, *, model_name: str,
        split: str, scored_tokens: int, progress: bool = True) -> int:
    """Every configuration on every window not yet in ``store``; returns the records written.

    ``configs`` as ``evaluation.engine.runner.configurations`` builds them (the full cache first: its
    record, measured like any other, has KL 0). Records (``evaluation.tasks.prose`` lists the metrics):
    model, dataset, data_dir (the context length), split, task (the essay), example_id (the
    window), press, compression_ratio, seed, kl, nll, nll_full, nll_delta, top1, realised_ratio,
    kv_bytes, bias_bytes, seconds (compression + scoring), prefill_seconds (the window's shared
    prefill and reference forward), n_context, scored_tokens."""
    t = scored_tokens
    todo = pending(windows, [context_length(w, t) for w in windows], configs, store, dataset=DATASET,
                   model_name=model_name)
    bar = tqdm(total=sum(len(c) for *_, c in todo), desc=f"prose/{split}", disable=not progress)
    written = 0
    for w, n, base, cfgs in todo:
        begun = start = time.perf_counter()
        ids = w.ids.to(model.device)
        context, fed, targets = ids[:, :n], ids[:, n : n + t], ids[0, n + 1 :]
        shared = Prefill(model, context, [c.build() for c in cfgs])
        reference, _ = teacher_forced(model, shared.compress(None), fed, n)
        prefill_seconds = time.perf_counter() - start
        for cfg in cfgs:
            start = time.perf_counter()
            with compressed(shared, cfg, n) as (cache, memory):
                logits, _ = teacher_forced(model, cache, fed, n)
            del cache
            store.append([base | dict(
                split=split, task=w.essay, press=cfg.label, compression_ratio=cfg.compression_ratio, seed=cfg.seed,
                **window_metrics(reference, logits, targets), **memory, seconds=time.perf_counter() - start,
                prefill_seconds=prefill_seconds, n_context=n, scored_tokens=t)])
            written += 1
            bar.update(1)
        logger.info("%s: %d configurations, prefill %.1fs, total %.1fs", w.window_id, len(cfgs), prefill_seconds,
                    time.perf_counter() - begun)
        del shared
    bar.close()
    return written
