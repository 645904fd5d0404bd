"""KVzip's scores as labels for a learned scorer, and the attention inputs they pair with.

The labels of a context are ``KVzipSampledPress``'s scores (kvpress's reconstruction pass, max attention over the
repeat), (L, H, n) float32, cached per context (sha256 of its ids) under the model's folder
(``artefacts.model_dir``), so every learned artefact of the model reads the same labels. The inputs are each
layer's attention input from one plain prefill of the context (not cached: one forward).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from transformers import DynamicCache

from kvpress_prob.presses.artefacts import model_dir
from kvpress_prob.presses.gate_store import VERSION
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.sampling import language_model


def ids_digest(ids: torch.Tensor) -> str:
    """The key of a context's labels: the first 16 hex digits of the sha256 of its ids."""
    return hashlib.sha256(ids.detach().to("cpu", torch.long).numpy().tobytes()).hexdigest()[:16]


class _LabelPress(KVzipSampledPress):
    """KVzipSampledPress's scoring pass, keeping its scores (and where they start) instead of evicting."""

    def compress_post(self, model):
        self.labels = self.score_val.float()[:, 0].clone()  # (L, H, n)
        self.scored_from = int(self.prefix_length)


@torch.no_grad()
def kvzip_labels(model, ids: torch.Tensor, folder: Path | None = None) -> tuple[torch.Tensor, int]:
    """KVzip's scores (L, H, n) float32 of context ``ids`` (1, n) and the first position it scores; cached in
    ``folder`` (default ``artefacts.model_dir(model) / "labels-v<VERSION>"``: labels of another version of the
    label rules are never read) by the ids' digest."""
    folder = Path(folder) if folder is not None else model_dir(model) / f"labels-v{VERSION}"
    path = folder / f"{ids_digest(ids)}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return saved["labels"], int(saved["scored_from"])
    press = _LabelPress(compression_ratio=0.5)  # any ratio > 0 runs the pass; the scores do not read it
    with press(model):
        model.model(input_ids=ids.to(model.device), past_key_values=DynamicCache())
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.save({"labels": press.labels.cpu(), "scored_from": press.scored_from}, tmp)
    os.replace(tmp, path)
    return press.labels.cpu(), press.scored_from


@torch.no_grad()
def attention_inputs(model, ids: torch.Tensor) -> torch.Tensor:
    """Every layer's attention input (L, n, d) float32 in one plain prefill of ``ids`` (1, n)."""
    captured: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs):
        captured[module.layer_idx] = kwargs["hidden_states"][0].float().cpu()

    layers = language_model(model).layers
    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        model.model(input_ids=ids.to(model.device), past_key_values=DynamicCache())
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([captured[i] for i in range(len(layers))])


__all__ = ["attention_inputs", "ids_digest", "kvzip_labels"]
