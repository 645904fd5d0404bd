"""The recall run: every configuration on every window not yet in the store, one record at a time.

Each window is prefilled once for every press, ratio and seed (``evaluation.engine.Prefill``, shared
with the prose benchmark); the full cache's logits on each cue are the reference; each configuration
compresses the prefill and every cue is teacher-forced on that compressed cache, which is restored
between cues (a cue never sees another cue).
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from evaluation.engine import Prefill, teacher_forced
from evaluation.engine.runner import Config
from evaluation.metrics.continuation import kl_per_position, nll_per_position
from evaluation.store.results import ResultStore
from evaluation.tasks.prose.measure import compressed, pending
from evaluation.tasks.recall import DATASET
from evaluation.tasks.recall.cues import RecallWindow

logger = logging.getLogger("evaluation.tasks.recall")


def cue_logits(model, cache, cue, n: int) -> torch.Tensor:
    """The (T, V) logits predicting ``cue.targets`` after the context's ``n`` tokens on ``cache``
    (fed: the cue, then the targets but the last); ``cache`` is left as it was."""
    saved = [(layer.keys, layer.values) for layer in cache.layers]
    fed = torch.cat([cue.cue, cue.targets[None, :-1]], dim=1).to(saved[0][0].device)
    try:
        logits, _ = teacher_forced(model, cache, fed, n)
    finally:
        for layer, (keys, values) in zip(cache.layers, saved):
            layer.keys, layer.values = keys, values
    return logits[cue.cue.shape[1] - 1 :]


def cue_metrics(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """One cue: token accuracy of the press and of the full cache (argmax = target), whether the press
    got every target token, mean NLL increase and mean KL(full || press) per token."""
    targets = targets.to(logits.device)
    hit, hit_full = logits.argmax(-1) == targets, reference.argmax(-1) == targets
    nll, nll_full = nll_per_position(logits, targets), nll_per_position(reference, targets)
    return {"acc": float(hit.double().mean()), "acc_full": float(hit_full.double().mean()),
            "exact": float(hit.all()), "nll_delta": float((nll - nll_full).mean()),
            "kl": float(kl_per_position(reference, logits).mean())}


def window_metrics(per_cue: list[dict]) -> dict:
    """A window's record: each metric's mean over its cues (in [0, 100] for the accuracies), and the
    per-cue accuracies."""
    out = {key: sum(c[key] for c in per_cue) / len(per_cue) for key in per_cue[0]}
    for key in ("acc", "acc_full", "exact"):
        out[key] *= 100
    return out | {"cue_acc": [round(100 * c["acc"], 2) for c in per_cue]}


@torch.no_grad()
def run(model, windows: list[RecallWindow], configs: list[Config], store: ResultStore, *, model_name: str,
        split: str, progress: bool = True) -> int:
    """Every configuration on every window not yet in ``store``; returns the records written. Records:
    model, dataset, data_dir (the context length), split, task (essay), example_id (window), press,
    compression_ratio, seed, acc, acc_full, exact, nll_delta, kl, cue_acc, cues, cue_starts,
    realised_ratio, kv_bytes, bias_bytes, seconds, prefill_seconds, n_context."""
    todo = pending(windows, [w.ids.shape[1] for w in windows], configs, store, dataset=DATASET,
                   model_name=model_name)
    bar = tqdm(total=sum(len(c) for *_, c in todo), desc=f"recall/{split}", disable=not progress)
    written = 0
    for w, n, base, cfgs in todo:
        start = time.perf_counter()
        context = w.ids.to(model.device)
        shared = Prefill(model, context, [c.build() for c in cfgs])
        full = shared.compress(None)
        references = [cue_logits(model, full, cue, n) for cue in w.cues]
        del full
        prefill_seconds = time.perf_counter() - start
        for cfg in cfgs:
            start = time.perf_counter()
            with compressed(shared, cfg, n) as (cache, memory):
                per_cue = [cue_metrics(ref, cue_logits(model, cache, cue, n), cue.targets)
                           for ref, cue in zip(references, w.cues)]
            del cache
            store.append([base | dict(
                split=split, task=w.essay, press=cfg.label, compression_ratio=cfg.compression_ratio, seed=cfg.seed,
                **window_metrics(per_cue), cues=len(w.cues), cue_starts=[c.start for c in w.cues], **memory,
                seconds=time.perf_counter() - start, prefill_seconds=prefill_seconds, n_context=n)])
            written += 1
            bar.update(1)
        del shared
    bar.close()
    return written
