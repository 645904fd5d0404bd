"""Learned artefacts on disk: a model's key, where its artefacts live, and their safetensors files.

A learned artefact (a gate, a budget profile) is trained for one model. ``model_key`` names the model by what it
computes, not by where it was loaded from (no path enters it): its architecture (``config.model_type``) and a
digest of its shapes and of the signs of its first and last layers' key weights. An artefact is looked up in the
user's cache, ``model_dir(model)`` (``$KVPROB_CACHE/learned/<model_key>``), then among the package's files,
``PACKAGE_DIR/<model_key>`` (``kvpress_prob/learned/artefacts/``, package data: the embedded model's defaults).

An artefact file is safetensors: its tensors, and as metadata (JSON values) at least ``model_key`` and the
model's ``shapes``, so that loading refuses an artefact trained for another model (``check_model``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvpress_prob.models import cache_dir
from kvpress_prob.presses.sampling import language_model

#: The package's artefacts (package data), one folder per model key.
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "learned" / "artefacts"


def shapes(model) -> dict[str, int]:
    """The shapes an artefact of ``model`` depends on: layers, hidden size, attention and KV heads."""
    config = model.config
    return {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}


def model_key(model) -> str:
    """The model's key, ``<model_type>-<digest>``: the digest covers its shapes and the signs of the first 4096
    entries of its first and last layers' key weights, which casting to bfloat16 or float16 keeps (one artefact
    serves the model in every dtype) and which no path, name or machine changes."""
    layers = language_model(model).layers
    s = shapes(model)
    digest = hashlib.sha256(json.dumps([s["num_hidden_layers"], s["hidden_size"], s["num_attention_heads"],
                                        s["num_key_value_heads"]], sort_keys=True).encode())
    for proj in (layers[0].self_attn.k_proj.weight, layers[-1].self_attn.k_proj.weight):
        digest.update((proj.detach().flatten()[:4096] > 0).cpu().numpy().tobytes())
    return f"{model.config.model_type or 'model'}-{digest.hexdigest()[:12]}"


def model_dir(model, key: str | None = None) -> Path:
    """Where the labels and artefacts of ``model`` (of key ``key`` when given) are cached:
    ``$KVPROB_CACHE/learned/<model_key>``."""
    return cache_dir() / "learned" / (key or model_key(model))


def find(model, filename: str, key: str | None = None) -> Path | None:
    """The artefact ``filename`` of ``model``: in the user's cache (``model_dir``), else among the package's files
    (``PACKAGE_DIR/<model_key>``); None if neither holds it."""
    key = key or model_key(model)
    for folder in (model_dir(model, key), PACKAGE_DIR / key):
        if (folder / filename).is_file():
            return folder / filename
    return None


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write ``tensors`` and ``meta`` (each value stored as JSON) to the safetensors file ``path``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={k: json.dumps(v) for k, v in meta.items()})
    os.replace(tmp, path)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of the safetensors file ``path`` (metadata values decoded from JSON)."""
    with safe_open(str(path), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def read_meta(path: Path) -> dict:
    """The metadata of the safetensors file ``path`` alone (no tensor is read)."""
    with safe_open(str(path), framework="pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}


def check_model(model, meta: dict, source, what: str = "artefact", key: str | None = None) -> None:
    """Refuse an artefact trained for another model: ``meta`` (its metadata) must name ``model``'s shapes and key.
    ``source`` (its path) and ``what`` name it in the error."""
    key = key or model_key(model)
    if "model_key" not in meta:
        raise ValueError(f"the {what} {source} records no model_key: it cannot be checked against this model "
                         f"({key}); retrain it with `kvprob train-gate`")
    recorded, expected = meta.get("shapes", {}), shapes(model)
    wrong = {k: (recorded.get(k), v) for k, v in expected.items() if recorded.get(k) != v}
    if wrong:
        raise ValueError(f"the {what} {source} was trained for a model of other shapes: "
                         + ", ".join(f"{k} {a} (this model: {b})" for k, (a, b) in wrong.items()))
    if meta["model_key"] != key:
        raise ValueError(f"the {what} {source} was trained for the model {meta['model_key']} "
                         f"({meta.get('model', 'unnamed')}), not this one ({key}): same shapes, other weights; "
                         f"train one for this model with `kvprob train-gate`")


__all__ = ["PACKAGE_DIR", "check_model", "find", "model_dir", "model_key", "read", "read_meta", "save", "shapes"]
