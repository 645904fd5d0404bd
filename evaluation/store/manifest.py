"""Run manifests: what a results file was computed with, so that a resume or a merge cannot mix settings.

Every results file ``<name>.jsonl`` written by ``kvprob run`` / ``reproduce`` has a manifest
``<name>.manifest.json`` beside it::

    {"identity": {...}, "runs": [{...}, ...], "assumed": "..." (only over a legacy file)}

``identity`` holds what can change a score; every results file of one folder must share it, so a
resume whose identity differs stops before anything is computed (``ManifestMismatch`` names each
differing field with both values), and ``kvprob merge`` refuses shards whose identities differ:

    model, model_digest (config and a sample of the weights), tokenizer_digest
    (vocabulary, special tokens, chat template), dataset, dataset_version (the RULER generator's,
    the prose windows'), data_seed, context_length, query_aware, dtype; the prose benchmark's split
    and scored_tokens (it has no data seed)

``runs`` gets one entry per invocation, with what is recorded but may differ between runs:

    n_examples, tasks (which examples: an example is a function of (data seed, task, index), so a
    later run may add or drop examples without changing the ones done), decode_batch (the answers
    equal up to float rounding), shard, device (float rounding), package_version, git_commit (None
    outside a git checkout; "-dirty" when tracked files differ from it), torch, transformers and
    kvpress versions, started (UTC time).

A results file without a manifest was written before manifests existed (a legacy file). Its
records carry model, dataset and data_dir (the context length), which are checked; its data seed
is read from the folder's ``data_seed.json`` when present; everything else is assumed to be the
current run's, and the manifest written on resume says so under ``assumed``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from evaluation.store.results import write_atomic

SUFFIX = ".manifest.json"
LEGACY_SEED_FILE = "data_seed.json"
IDENTITY = ("model", "model_digest", "tokenizer_digest", "dataset", "dataset_version", "data_seed",
            "context_length", "query_aware", "dtype", "split", "scored_tokens")
LEGACY_ASSUMED = ("model_digest", "tokenizer_digest", "dataset_version", "query_aware", "dtype")


class ManifestMismatch(ValueError):
    """A resume or a merge would mix results computed with different settings."""


def manifest_path(results_file: Path | str) -> Path:
    """``<folder>/<name>.manifest.json`` for ``<folder>/<name>.jsonl``."""
    path = Path(results_file)
    return path.with_name(path.name.removesuffix(".jsonl") + SUFFIX)


def read(results_file: Path | str) -> dict | None:
    """The manifest of a results file, or None for a file written before manifests (legacy)."""
    path = manifest_path(results_file)
    return json.loads(path.read_text()) if path.exists() else None


# --------------------------------------------------------------------------- digests


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_digest(model) -> str:
    """Digest of the config (without path, dtype and attention backend) and of the first 64 values of
    every parameter rounded to bfloat16, so that one checkpoint in float32 or bfloat16 reads the same."""
    import torch

    volatile = {"_name_or_path", "name_or_path", "_attn_implementation", "_attn_implementation_autoset",
                "attn_implementation", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}
    config = {k: v for k, v in model.config.to_dict().items() if k not in volatile}
    sample = {name: p.detach().flatten()[:64].to("cpu", torch.bfloat16).float().tolist()
              for name, p in model.named_parameters() if p.device.type != "meta"}  # offloaded weights: skipped
    return _digest([config, sample])


def tokenizer_digest(tokenizer) -> str:
    """Digest of the vocabulary, the special tokens and the chat template (not the tokenizer's path)."""
    return _digest([sorted(tokenizer.get_vocab().items()), tokenizer.all_special_tokens,
                    getattr(tokenizer, "chat_template", None), tokenizer.eos_token])


def git_commit() -> str | None:
    """The commit of the checkout this package runs from, "-dirty" if tracked files differ; None outside git."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD"]).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- building


def identity(*, model: str, dataset: str, data_seed: int | None, context_length: int, query_aware: bool,
             loaded_model=None, tokenizer=None, split: str | None = None, scored_tokens: int | None = None,
             dataset_version: str | int | None = None) -> dict:
    """The fields that must match on resume. Without ``loaded_model`` / ``tokenizer`` (before loading)
    the digests and dtype are left out, and checks compare only the fields present. The prose benchmark
    has no data seed (None) but a ``split`` and a number of ``scored_tokens``. ``dataset_version`` is the
    task's own (its generator's or its split's), passed in by the task's command; None: none recorded."""
    ident = dict(model=model, dataset=dataset, context_length=int(context_length), query_aware=bool(query_aware))
    if data_seed is not None:
        ident["data_seed"] = int(data_seed)
    if split is not None:
        ident["split"] = str(split)
    if scored_tokens is not None:
        ident["scored_tokens"] = int(scored_tokens)
    if dataset_version is not None:
        ident["dataset_version"] = dataset_version
    if loaded_model is not None:
        ident["model_digest"] = model_digest(loaded_model)
        ident["dtype"] = str(loaded_model.dtype).removeprefix("torch.")
    if tokenizer is not None:
        ident["tokenizer_digest"] = tokenizer_digest(tokenizer)
    return {k: ident[k] for k in IDENTITY if k in ident}


def run_entry(*, n_examples: int | None, tasks: list[str] | None, decode_batch: int, shard: str | None,
              device: str | None) -> dict:
    """What one invocation records beside the identity (allowed to differ between runs)."""
    return dict(n_examples=n_examples, tasks=list(tasks) if tasks else None, decode_batch=decode_batch,
                shard=shard, device=device, package_version=_version("kvpress-prob"), git_commit=git_commit(),
                torch=_version("torch"), transformers=_version("transformers"), kvpress=_version("kvpress"),
                started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


# --------------------------------------------------------------------------- checking


def differences(recorded: dict, current: dict) -> list[str]:
    """``field: <recorded> (where) vs <current>`` for every identity field both hold with different values."""
    return [f"{k}: {recorded[k]!r} vs {current[k]!r}" for k in IDENTITY
            if k in recorded and k in current and recorded[k] != current[k]]


def _legacy_identity(results_file: Path, data_dir: str) -> dict:
    """What a legacy file's records and the folder's data_seed.json say about its identity."""
    from evaluation.store.results import ResultStore

    found: dict = {}
    seed_file = results_file.parent / LEGACY_SEED_FILE
    if seed_file.exists():
        found["data_seed"] = json.loads(seed_file.read_text())["data_seed"]
    records = ResultStore(results_file, readonly=True).records()
    for field in ("model", "dataset"):
        values = sorted({str(r.get(field)) for r in records})
        if values:
            found[field] = values[0] if len(values) == 1 else values
    data_dirs = sorted({str(r.get("data_dir")) for r in records})
    if data_dirs and data_dirs != [data_dir]:
        found["data_dir"] = data_dirs[0] if len(data_dirs) == 1 else data_dirs
    return found


def check_folder(folder: Path | str, current: dict, *, data_dir: str) -> list[str]:
    """Raise ``ManifestMismatch`` if a results file in ``folder`` was computed with another identity.

    ``current`` may be partial (see ``identity``). ``data_dir`` is the records' data_dir for this run,
    checked against legacy files. Returns notes (one per legacy file: what is assumed), to print.
    """
    folder = Path(folder)
    problems, notes = [], []
    written = {p.with_name(p.name.removesuffix(SUFFIX) + ".jsonl") for p in folder.glob("*" + SUFFIX)}
    for results_file in sorted(set(folder.glob("*.jsonl")) | written):
        manifest = read(results_file)
        if manifest is not None:
            recorded, where = manifest["identity"], manifest_path(results_file)
        else:
            recorded, where = _legacy_identity(results_file, data_dir), results_file
            if "data_dir" in recorded:
                problems.append(f"  data_dir (context length): {recorded['data_dir']!r} vs {data_dir!r}   ({where})")
            notes.append(f"{results_file} has no manifest (written before run manifests): its records' model "
                         f"and dataset and {LEGACY_SEED_FILE} (data seed, if present) are checked; "
                         f"{', '.join(LEGACY_ASSUMED)} are assumed to be this run's")
        problems += [f"  {d}   ({where})" for d in differences(recorded, current)]
    if problems:
        raise ManifestMismatch(f"{folder} holds results computed with other settings (field: folder vs this run):\n"
                               + "\n".join(problems)
                               + "\nrun these settings into their own --out folder")
    return notes


def write(results_file: Path | str, current: dict, entry: dict, notes: list[str] = ()) -> Path:
    """Record a run in the manifest of ``results_file`` (created if absent; legacy notes go to ``assumed``)."""
    manifest = read(results_file) or {"identity": {}, "runs": []}
    manifest["identity"] = {**manifest["identity"], **current}
    manifest["runs"].append(entry)
    legacy = [n for n in notes if n.startswith(str(results_file))]
    if legacy and "assumed" not in manifest:
        manifest["assumed"] = legacy[0]
    return write_atomic(manifest_path(results_file), json.dumps(manifest, indent=2) + "\n")


def merge(shards: list[Path], out: Path) -> list[str]:
    """Refuse shards whose identities differ; write ``out``'s manifest (their runs joined). Returns notes."""
    missing = [str(s) for s in shards if not Path(s).exists()]
    if missing:
        raise FileNotFoundError(f"no such shard file(s): {', '.join(missing)}")
    manifests = {Path(s): read(s) for s in shards}
    known = {s: m for s, m in manifests.items() if m is not None}
    notes = [f"{s} has no manifest (written before run manifests): merged as is" for s, m in manifests.items()
             if m is None]
    if not known:
        return notes
    first, reference = next(iter(known.items()))
    problems = [f"  {s}: {d}" for s, m in known.items() for d in differences(reference["identity"], m["identity"])]
    if problems:
        raise ManifestMismatch(f"shards computed with other settings than {first} (field: {first.name} vs shard):\n"
                               + "\n".join(problems))
    merged = {"identity": reference["identity"], "runs": [r for m in known.values() for r in m["runs"]]}
    if notes:
        merged["assumed"] = "; ".join(notes)
    write_atomic(manifest_path(out), json.dumps(merged, indent=2) + "\n")
    return notes
