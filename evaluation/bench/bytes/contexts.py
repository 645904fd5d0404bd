"""The context ids of the examples a records folder holds, rebuilt from its manifest (RULER, prose, recall)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def identity(folder: Path) -> dict:
    """The manifest's identity of a records folder (model, dataset, context length, split, ...)."""
    return json.loads((Path(folder) / "results.manifest.json").read_text())["identity"]


def _ruler(folder: Path, model, tokenizer, ids: set[str]) -> dict[str, torch.Tensor]:
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from evaluation.tasks.ruler.offline import generate_ruler

    manifest = json.loads((Path(folder) / "results.manifest.json").read_text())
    ident, runs = manifest["identity"], manifest["runs"]
    widest = max(runs, key=lambda run: run["n_examples"] or 0)  # the run that generated every example
    n_examples, tasks = widest["n_examples"], widest.get("tasks") or None
    df = generate_ruler(tokenizer, ident["context_length"], n_examples, seed=ident["data_seed"], tasks=tasks)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)  # the runner's preprocessing
    out = {}
    for _, row in df[df["example_id"].isin(ids)].iterrows():
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
        out[row["example_id"]] = inputs["context_ids"]
    return out


def _prose(folder: Path, model, tokenizer, ids: set[str]) -> dict[str, torch.Tensor]:
    from evaluation.tasks.prose.essays import windows
    from evaluation.tasks.prose.measure import context_length

    ident = identity(folder)
    t = ident["scored_tokens"]
    found = windows(tokenizer, ident["context_length"], t, ident["split"])
    return {w.window_id: w.ids[:, : context_length(w, t)] for w in found if w.window_id in ids}


def _recall(folder: Path, model, tokenizer, ids: set[str]) -> dict[str, torch.Tensor]:
    from evaluation.tasks.recall import SCORED_TOKENS
    from evaluation.tasks.recall.cues import windows

    ident = identity(folder)
    version = ident["dataset_version"]  # ".../sentences<s>/cue<c>"
    sentences = int(version.split("/sentences")[1].split("/")[0])
    cue = int(version.split("/cue")[1].split("/")[0])
    found = windows(tokenizer, ident["context_length"], ident["split"], sentences, cue, SCORED_TOKENS)
    return {w.window_id: w.ids for w in found if w.window_id in ids}


LOADERS = {"ruler": _ruler, "prose": _prose, "recall": _recall}


def contexts(folder: Path, model, tokenizer, ids: set[str]) -> dict[str, torch.Tensor]:
    """example_id -> context ids (1, n) for the ``ids`` of the records in ``folder``; raises if one is missing."""
    dataset = identity(folder)["dataset"]
    if dataset not in LOADERS:
        raise ValueError(f"{folder}: dataset {dataset!r} has no context loader (one of {sorted(LOADERS)})")
    found = LOADERS[dataset](Path(folder), model, tokenizer, ids)
    missing = sorted(ids - set(found))
    if missing:
        raise ValueError(f"{folder}: {len(missing)} example(s) not rebuilt from the manifest, e.g. {missing[:3]}")
    return found
