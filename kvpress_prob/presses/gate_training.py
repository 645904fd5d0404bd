"""Training Fast KVzip's gates on KVzip's scores, cached outside the repository.

Fast KVzip (Kim, Han, Yun, arXiv 2601.17668) fits, per layer, a ``FastKVzipGate`` on pairs (the attention
module's input hidden state of each context token, KVzip's reconstruction score of that token in each KV head).
Here:

- labels: ``KVzipSampledPress``'s scores (kvpress's reconstruction pass, max attention over the repeat) of each
  training context, (L, H, n) float32, cached per context (sha256 of its ids) under the model's folder;
- inputs: each layer's attention input from one plain prefill of the context (not cached: one forward);
- loss: Fast KVzip's default (``"cnt"`` in its ``optim.py``): binary cross-entropy between the gate's output in
  (0, 1) and KVzip's score in [0, 1], averaged over tokens, summed over heads and layers; the first ``n_sink``
  positions, which the press pins, and the chat prefix KVzip leaves unscored are left out;
- optimiser: Fast KVzip's, SGD with momentum 0.9 at lr 0.2, 1 % warm-up then x0.5 at half and x0.25 at three
  quarters of the steps, minibatches of ``batch_size`` tokens drawn with a seeded generator; deterministic
  algorithms, float32; the same data and seed give the same gate.

The gate is stored as kvpress's ``FastKVzipPress`` format, ``{"module": [state dict per layer], "meta": {...}}``,
in ``gate_dir(model)`` (``$KVPROB_CACHE/gates/...``, like the RULER data), keyed by the model (its name, shapes and
a digest of some weights), the contexts and the training settings. ``cached_gates`` reads it, or trains it once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from kvpress.presses.fastkvzip_press import FastKVzipGate
from transformers import AutoTokenizer, DynamicCache

from kvpress_prob.models import cache_dir
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.allocations import allocation_keep
from kvpress_prob.presses.sampling import language_model

logger = logging.getLogger(__name__)

_PATHS: dict = {}  # (model_key, corpus) -> (its gate's path, its contexts)
VERSION = 1  # of the label and training rules below: a change retrains every cached gate


@dataclass(frozen=True)
class TrainSettings:
    """Fast KVzip's gate and optimiser settings: its ``optim.py`` defaults, except the step count (300, not 5000) and
    the batch, sized for a CPU."""

    output_dim: int = 16
    sink: int = 16
    steps: int = 300
    batch_size: int = 1000
    lr: float = 0.2
    seed: int = 0
    n_sink: int = 4  # positions the press pins, left out of the loss


def model_key(model) -> str:
    """The model's folder name: its name, shapes and a digest of the signs of its first and last layers' key
    weights, which casting to bfloat16 or float16 keeps, so one gate serves the model in every dtype."""
    config = model.config
    name = Path(str(config.name_or_path or "model")).name.lower() or "model"
    layers = language_model(model).layers
    digest = hashlib.sha256(json.dumps([config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                        config.num_key_value_heads], sort_keys=True).encode())
    for proj in (layers[0].self_attn.k_proj.weight, layers[-1].self_attn.k_proj.weight):
        digest.update((proj.detach().flatten()[:4096] > 0).cpu().numpy().tobytes())
    return f"{name}-{digest.hexdigest()[:12]}"


def gate_dir(model) -> Path:
    """Where the labels and gates of ``model`` are cached: ``$KVPROB_CACHE/gates/<model_key>``."""
    return cache_dir() / "gates" / model_key(model)


def _ids_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.detach().to("cpu", torch.long).numpy().tobytes()).hexdigest()[:16]


class _LabelPress(KVzipSampledPress):
    """KVzipSampledPress's scoring pass, keeping its scores (and where they start) instead of evicting."""

    def compress_post(self, model):
        self.labels = self.score_val.float()[:, 0].clone()  # (L, H, n)
        self.scored_from = int(self.prefix_length)


@torch.no_grad()
def kvzip_labels(model, ids: torch.Tensor, folder: Path | None = None) -> tuple[torch.Tensor, int]:
    """KVzip's scores (L, H, n) float32 of context ``ids`` (1, n) and the first position it scores; cached in
    ``folder`` (default ``gate_dir(model) / "labels"``) by the ids' digest."""
    folder = Path(folder) if folder is not None else gate_dir(model) / "labels"
    path = folder / f"{_ids_digest(ids)}.pt"
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


@contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode on CUDA
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _lr_factor(step: int, steps: int) -> float:
    """Fast KVzip's schedule: linear warm-up over the first 1 %, then 1, 0.5 from half-way, 0.25 from 3/4."""
    if step < 0.01 * steps:
        return step / (0.01 * steps)
    return 1.0 if step < 0.5 * steps else 0.5 if step < 0.75 * steps else 0.25


def new_gates(model, settings: TrainSettings) -> list[FastKVzipGate]:
    """Freshly initialised float32 gates for ``model`` (seeded by ``settings.seed``)."""
    config = model.config
    torch.manual_seed(settings.seed)
    heads = config.num_key_value_heads
    return [FastKVzipGate(i, config.hidden_size, heads, config.num_attention_heads // heads, torch.float32,
                          settings.output_dim, settings.sink) for i in range(config.num_hidden_layers)]


def train_gates(model, inputs: list[torch.Tensor], labels: list[tuple[torch.Tensor, int]],
                settings: TrainSettings, log_every: int = 0) -> tuple[list[FastKVzipGate], dict]:
    """Fit one gate per layer on ``inputs`` (per context, (L, n, d)) and ``labels`` (per context, KVzip's (L, H, n)
    and its first scored position) with Fast KVzip's loss and optimiser (see the module). Returns the gates and
    the training record (final loss, seconds, token count)."""
    start = time.perf_counter()
    first = [max(settings.n_sink, scored_from) for _, scored_from in labels]
    device = next(model.parameters()).device  # trained on the model's (first) device
    x = torch.cat([h[:, f:] for h, f in zip(inputs, first)], dim=1).to(device, torch.float32)  # (L, N, d)
    y = torch.cat([s[:, :, f:] for (s, _), f in zip(labels, first)], dim=2).clamp(0.0, 1.0).to(device)  # (L, H, N)
    n_tokens = x.shape[1]
    with torch.enable_grad(), _deterministic():  # a press trains on first use, often inside torch.no_grad()
        gates = [g.to(device) for g in new_gates(model, settings)]
        params = [p for g in gates for p in g.parameters()]
        optimiser = torch.optim.SGD(params, lr=settings.lr, momentum=0.9)
        generator = torch.Generator().manual_seed(settings.seed)
        order, cursor, losses = torch.randperm(n_tokens, generator=generator), 0, []
        for step in range(settings.steps):
            if cursor + settings.batch_size > n_tokens:
                order, cursor = torch.randperm(n_tokens, generator=generator), 0
            batch = order[cursor: cursor + settings.batch_size].to(device)
            cursor += settings.batch_size
            optimiser.zero_grad(set_to_none=True)
            loss = sum(F.binary_cross_entropy(g(x[i, batch])[0], y[i][:, batch], reduction="none").mean(-1).sum()
                       for i, g in enumerate(gates))
            loss.backward()
            for group in optimiser.param_groups:
                group["lr"] = settings.lr * _lr_factor(step, settings.steps)
            optimiser.step()
            losses.append(loss.detach().item())
            if log_every and (step % log_every == 0 or step == settings.steps - 1):
                logger.info("gate step %d/%d: loss %.4f (%.0f s)", step, settings.steps, losses[-1],
                            time.perf_counter() - start)
    tail = losses[-max(1, settings.steps // 20):]
    record = {"loss_last5pct": sum(tail) / len(tail), "loss_first": losses[0] if losses else None,
              "seconds": time.perf_counter() - start, "tokens": n_tokens}
    return [g.eval() for g in gates], record


def gates_from_state_dicts(state_dicts: list[dict]) -> list[FastKVzipGate]:
    """kvpress ``FastKVzipGate`` modules from a list of their per-layer state dicts (``FastKVzipPress``'s format;
    the shapes give the input width, heads, group size, output width and sinks)."""
    gates = []
    for index, state in enumerate(state_dicts):
        head_group_out, input_dim = state["q_proj.weight"].shape
        head_out = state["k_proj.weight"].shape[0]
        output_dim = state["q_norm.weight"].shape[-1]
        sink = state["k_base"].shape[2] if "k_base" in state else 0
        gate = FastKVzipGate(index, input_dim, head_out // output_dim, head_group_out // head_out,
                             state["q_proj.weight"].dtype, output_dim, sink)
        gate.load_state_dict(state)
        gates.append(gate.eval())
    return gates


@torch.no_grad()
def gate_scores(gates: list[FastKVzipGate], inputs: torch.Tensor) -> torch.Tensor:
    """The gates' scores (L, H, n) of one context's attention inputs (L, n, d)."""
    return torch.stack([g(inputs[i].to(g.q_proj.weight.dtype))[0].float() for i, g in enumerate(gates)])


def _pinned(scores: torch.Tensor, n_sink: int) -> torch.Tensor:
    scores = scores.clone()[:, None]  # (L, 1, H, n)
    scores[..., :n_sink] = scores.amax() + 1.0
    return scores


def kept_recall(gate: torch.Tensor, kvzip: torch.Tensor, ratio: float, n_sink: int = 4) -> tuple[int, int]:
    """(entries of KVzip's kept set the gate also keeps, entries of KVzip's kept set), both under the widest
    allocation at ``ratio`` with the first ``n_sink`` positions pinned; ``gate`` and ``kvzip`` are (L, H, n)."""
    keep_gate = allocation_keep(_pinned(gate, n_sink), ratio, "widest")
    keep_kvzip = allocation_keep(_pinned(kvzip, n_sink), ratio, "widest")
    return int((keep_gate & keep_kvzip).sum()), int(keep_kvzip.sum())


def gate_path(model, contexts: list[torch.Tensor], settings: TrainSettings) -> Path:
    """The cached gate's file for these contexts and settings."""
    key = json.dumps({"contexts": [_ids_digest(c) for c in contexts], "settings": asdict(settings),
                      "version": VERSION}, sort_keys=True)
    return gate_dir(model) / f"gate-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def save_gates(gates: list[FastKVzipGate], path: Path, meta: dict) -> None:
    """Write ``gates`` in ``FastKVzipPress``'s format (``{"module": [state dicts]}``) with ``meta``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.save({"module": [{k: v.detach().cpu() for k, v in g.state_dict().items()} for g in gates], "meta": meta}, tmp)
    os.replace(tmp, path)


def load_gates(path: Path) -> list[FastKVzipGate]:
    """Gates from a file in ``FastKVzipPress``'s format (a dict with ``"module"``, or the list itself)."""
    saved = torch.load(path, weights_only=True)
    return gates_from_state_dicts(saved["module"] if isinstance(saved, dict) else saved)


def latest(model) -> Path | None:
    """The model's most recently written cached gate, or None."""
    found = sorted(gate_dir(model).glob("gate-*.pt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def fit(model, contexts: list[torch.Tensor], settings: TrainSettings | None = None, log_every: int = 0
        ) -> tuple[Path, dict]:
    """Labels (cached), inputs and training on ``contexts`` (a list of (1, n) ids); the gate is written to
    ``gate_path`` unless it is there already (``settings`` None: ``TrainSettings()``). Returns its path and the
    record (label and training seconds)."""
    settings = TrainSettings() if settings is None else settings
    path = gate_path(model, contexts, settings)
    if path.exists():
        return path, torch.load(path, weights_only=True)["meta"]
    t0 = time.perf_counter()
    labels = [kvzip_labels(model, ids) for ids in contexts]
    label_s = time.perf_counter() - t0
    inputs = [attention_inputs(model, ids) for ids in contexts]
    gates, record = train_gates(model, inputs, labels, settings, log_every)
    meta = {"contexts": len(contexts), "label_seconds": label_s, **record, "settings": asdict(settings)}
    save_gates(gates, path, meta)
    return path, meta


def cached_gates(model, corpus: Callable | None) -> list[FastKVzipGate]:
    """The gate of ``model``: the cached one trained on ``corpus(tokenizer)``'s contexts (trained now, on first use,
    with one log line), or, with ``corpus`` None, the latest cached gate of the model (else a clear error)."""
    if corpus is None:
        path = latest(model)
        if path is None:
            raise FileNotFoundError(
                f"no gate is cached for this model in {gate_dir(model)}: train one with `kvprob train-gate "
                f"--model {model.config.name_or_path}`, or pass GatePress(gates=...) (FastKVzipPress's format)")
        return load_gates(path)
    key = (model_key(model), corpus)
    if key not in _PATHS:  # the corpus is tokenised once per model and corpus
        contexts = corpus(AutoTokenizer.from_pretrained(model.config.name_or_path))
        settings = TrainSettings()
        _PATHS[key] = (gate_path(model, contexts, settings), contexts, settings)
    path, contexts, settings = _PATHS[key]
    if not path.exists():
        logger.warning("GatePress: no gate cached for this model; training one on %d development contexts "
                       "(KVzip labels, then Fast KVzip's loss), cached at %s", len(contexts), path)
        fit(model, contexts, settings)
    return load_gates(path)


__all__ = ["TrainSettings", "attention_inputs", "cached_gates", "fit", "gate_dir", "gates_from_state_dicts", "gate_path", "gate_scores",
           "kept_recall", "kvzip_labels", "latest", "load_gates", "model_key", "new_gates", "save_gates",
           "train_gates"]
