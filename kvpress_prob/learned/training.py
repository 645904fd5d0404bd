"""Training Fast KVzip's gates on KVzip's scores.

Fast KVzip (Kim, Han, Yun, arXiv 2601.17668) fits, per layer, a ``FastKVzipGate`` on pairs (the attention
module's input hidden state of each context token, KVzip's reconstruction score of that token in each KV head).
Here:

- labels and inputs: ``learned.labels`` (KVzip's scores, cached per context; one plain prefill's attention inputs);
- loss: Fast KVzip's default (``"cnt"`` in its ``optim.py``): binary cross-entropy between the gate's output in
  (0, 1) and KVzip's score in [0, 1], averaged over tokens, summed over heads and layers; the first ``n_sink``
  positions, which the press pins, and the chat prefix KVzip leaves unscored are left out;
- optimiser: Fast KVzip's, SGD with momentum 0.9 at lr 0.2, 1 % warm-up then x0.5 at half and x0.25 at three
  quarters of the steps, minibatches of ``batch_size`` tokens drawn with a seeded generator; deterministic
  algorithms, float32; the same data and seed give the same gate.

The gate is written where ``presses.gate_store`` reads it, named by its corpus and settings (``gate_name``).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from kvpress.presses.fastkvzip_press import FastKVzipGate
from tqdm.auto import tqdm

from kvpress_prob.learned.labels import attention_inputs, ids_digest, kvzip_labels
from kvpress_prob.presses import artefacts
from kvpress_prob.presses.allocations import allocation_keep
from kvpress_prob.presses.gate_store import VERSION, TrainSettings, gate_name, gate_path, save_gates


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
                settings: TrainSettings, progress: bool = False) -> tuple[list[FastKVzipGate], dict]:
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
        bar = tqdm(range(settings.steps), desc="gate training", disable=not progress)
        for step in bar:
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
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    tail = losses[-max(1, settings.steps // 20):]
    record = {"loss_last5pct": sum(tail) / len(tail), "loss_first": losses[0] if losses else None,
              "seconds": time.perf_counter() - start, "tokens": n_tokens}
    return [g.eval() for g in gates], record


@torch.no_grad()
def gate_scores(gates: list[FastKVzipGate], inputs: torch.Tensor) -> torch.Tensor:
    """The gates' scores (L, H, n) of one context's attention inputs (L, n, d)."""
    return torch.stack([g(inputs[i].to(g.q_proj.weight.dtype))[0].float() for i, g in enumerate(gates)])


def widest_keep(scores: torch.Tensor, ratio: float, n_sink: int = 4) -> torch.Tensor:
    """The kept set (L, H, n) bool of scores (L, H, n) under the widest allocation at ``ratio``, with the first
    ``n_sink`` positions pinned above every score (as a gate press pins them)."""
    pinned = scores.clone()[:, None]  # (L, 1, H, n)
    pinned[..., :n_sink] = pinned.amax() + 1.0
    return allocation_keep(pinned, ratio, "widest")[:, 0]


def kept_recall(gate: torch.Tensor, kvzip: torch.Tensor, ratio: float, n_sink: int = 4) -> tuple[int, int]:
    """(entries of KVzip's kept set the gate also keeps, entries of KVzip's kept set), both under the widest
    allocation at ``ratio`` with the first ``n_sink`` positions pinned; ``gate`` and ``kvzip`` are (L, H, n)."""
    keep_gate, keep_kvzip = widest_keep(gate, ratio, n_sink), widest_keep(kvzip, ratio, n_sink)
    return int((keep_gate & keep_kvzip).sum()), int(keep_kvzip.sum())


def fit(model, contexts: list[torch.Tensor], corpus: str, settings: TrainSettings | None = None,
        progress: bool = True, command: str | None = None) -> tuple[Path, dict]:
    """Labels (cached), inputs and training on ``contexts`` (a list of (1, n) ids), the corpus named ``corpus``;
    the gate is written to ``gate_path(model, gate_name(corpus, settings))`` unless it is there already
    (``settings`` None: ``TrainSettings()``), its metadata naming the model (``model_key``, ``shapes``), the
    corpus, the settings and ``command`` (the command that trains it). Returns its path and its metadata."""
    settings = TrainSettings() if settings is None else settings
    path = gate_path(model, gate_name(corpus, settings))
    digests = [ids_digest(c) for c in contexts]
    if path.exists():
        meta = artefacts.read_meta(path)
        if meta.get("context_digests", digests) != digests:
            raise ValueError(f"the gate {path.name} was trained on other contexts than the corpus {corpus!r} gives "
                             f"now: name the corpus by what defines it")
        return path, meta
    t0 = time.perf_counter()
    labels = [kvzip_labels(model, ids) for ids in tqdm(contexts, desc="KVzip labels", disable=not progress)]
    label_s = time.perf_counter() - t0
    inputs = [attention_inputs(model, ids) for ids in contexts]
    gates, record = train_gates(model, inputs, labels, settings, progress)
    meta = {"model_key": artefacts.model_key(model), "model": Path(str(model.config.name_or_path)).name,
            "shapes": artefacts.shapes(model), "version": VERSION, "corpus": corpus, "contexts": len(contexts),
            "context_digests": digests, "label_seconds": label_s, **record, "settings": asdict(settings),
            "command": command}
    save_gates(gates, path, meta)
    return path, meta


__all__ = ["fit", "gate_scores", "kept_recall", "new_gates", "train_gates", "widest_keep"]
