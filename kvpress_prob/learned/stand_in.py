"""Untrained stand-ins for a model's learned artefacts (the gate and the budget profile), for a model nothing was
trained for (random weights: the GPU check's shapes, the tests' tiny models): a learned press then runs at its
price, keeping entries at the right counts by random scores."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch

from kvpress_prob.learned.profile import GRID, N_SINK, save_profile
from kvpress_prob.learned.training import new_gates
from kvpress_prob.presses import artefacts, gate_store
from kvpress_prob.presses.budget_profile import PROFILE_FILE, Profile


@contextlib.contextmanager
def stand_in_artefacts(model):
    """While open, ``model`` (random weights) has a default gate and a budget profile in a temporary
    ``$KVPROB_CACHE``: freshly initialised gates (``learned.training.new_gates``, seed 0) and the uniform profile,
    written and checked as trained ones are. Their scores are random, so a press using them keeps random entries
    at the right counts: its prefill time, peak and decode step are the trained press's, its quality is not.
    ``$KVPROB_CACHE`` is restored on exit."""
    before = os.environ.get("KVPROB_CACHE")
    with tempfile.TemporaryDirectory(prefix="kvprob-stand-in-") as folder:
        os.environ["KVPROB_CACHE"] = folder
        try:
            settings = gate_store.TrainSettings()
            name = gate_store.gate_name("stand-in-untrained", settings)
            meta = {"model_key": artefacts.model_key(model), "model": "random weights",
                    "shapes": artefacts.shapes(model), "version": gate_store.VERSION,
                    "command": "kvprob gpu-check (untrained stand-in)"}
            gate_store.save_gates(new_gates(model, settings), gate_store.gate_path(model, name), meta)
            gate_store.set_default(model, name)
            L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
            uniform = torch.full((len(GRID), L, H), 1.0 / (L * H), dtype=torch.float64)
            save_profile(Profile(uniform, tuple(GRID), N_SINK, {"model_key": meta["model_key"]}),
                         artefacts.model_dir(model) / PROFILE_FILE)
            yield Path(folder)
        finally:
            if before is None:
                os.environ.pop("KVPROB_CACHE", None)
            else:
                os.environ["KVPROB_CACHE"] = before


__all__ = ["stand_in_artefacts"]
