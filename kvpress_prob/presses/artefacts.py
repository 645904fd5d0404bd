"""Where a model's learned artefacts live: its key, and its folder in the user's cache.

A learned artefact (a gate, a budget profile) is trained for one model. ``model_key`` names the model by what it
computes, not by where it was loaded from: its architecture, its shapes and a digest of the signs of its first
and last layers' key weights. ``model_dir`` is the model's folder under ``$KVPROB_CACHE`` (``models.cache_dir``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvpress_prob.models import cache_dir
from kvpress_prob.presses.sampling import language_model


def model_key(model) -> str:
    """The model's folder name: its name, shapes and a digest of the signs of its first and last layers' key
    weights, which casting to bfloat16 or float16 keeps, so one artefact serves the model in every dtype."""
    config = model.config
    name = Path(str(config.name_or_path or "model")).name.lower() or "model"
    layers = language_model(model).layers
    digest = hashlib.sha256(json.dumps([config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                        config.num_key_value_heads], sort_keys=True).encode())
    for proj in (layers[0].self_attn.k_proj.weight, layers[-1].self_attn.k_proj.weight):
        digest.update((proj.detach().flatten()[:4096] > 0).cpu().numpy().tobytes())
    return f"{name}-{digest.hexdigest()[:12]}"


def model_dir(model) -> Path:
    """Where the labels and artefacts of ``model`` are cached: ``$KVPROB_CACHE/gates/<model_key>``."""
    return cache_dir() / "gates" / model_key(model)


__all__ = ["model_dir", "model_key"]
