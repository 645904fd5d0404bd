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
in ``gate_dir(model)`` (``$KVPROB_CACHE/gates/<model_key>``, like the RULER data), in a file named by what defines
it (``gate_name``: the training corpus's name and the settings). A gate press loads the gate it is given by name
(``load``), else the model's default: the one ``set_default`` recorded (``kvprob train-gate --set-default``), else
``DEFAULT_GATE``; never a gate because it is the newest. A gate is read once per process.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from kvpress.presses.fastkvzip_press import FastKVzipGate
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvpress_prob.models import cache_dir
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.allocations import allocation_keep
from kvpress_prob.presses.sampling import language_model

VERSION = 3  # of the label and training rules below: a change renames every gate


@dataclass(frozen=True)
class TrainSettings:
    """Fast KVzip's gate and optimiser settings: its ``optim.py`` defaults, except the step count (200, not 5000) and
    the batch, sized for a CPU (training in under 3 minutes on one thread for SmolLM2-135M)."""

    output_dim: int = 16
    sink: int = 16
    steps: int = 200
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


def gate_name(corpus: str, settings: TrainSettings) -> str:
    """The name of the gate trained on the corpus named ``corpus`` with ``settings``: what defines it, spelled out
    (the model is its folder, ``gate_dir``)."""
    s = settings
    return (f"{corpus}-steps{s.steps}-batch{s.batch_size}-lr{s.lr:g}-dim{s.output_dim}-sink{s.sink}-pin{s.n_sink}"
            f"-seed{s.seed}-v{VERSION}")


#: The corpus ``kvprob train-gate`` trains on by default: the first 1024 tokens of 20 prose development windows and
#: 10 development RULER haystacks (``evaluation.tasks.prose.gate.contexts``).
DEFAULT_CORPUS = "dev-prose20-ruler10-1024"
#: The gate a gate press loads when none is named and the model has no default set (``set_default``).
DEFAULT_GATE = gate_name(DEFAULT_CORPUS, TrainSettings())
#: What training the default gate costs (results/gate/), for the error that asks for it.
TRAIN_TIME = ("about 8 minutes on one CPU thread for SmolLM2-135M: 6 for KVzip's labels of 30 contexts, 1.5 for "
              "training")


def gate_path(model, name: str) -> Path:
    """The file of the gate named ``name`` (``gate_name``) of ``model``."""
    return gate_dir(model) / f"{name}.pt"


def set_default(model, name: str) -> Path:
    """Make the gate ``name`` (trained, in ``gate_dir(model)``) the default of ``model``: what a gate press built by
    name loads. Returns the file recording it."""
    if not gate_path(model, name).exists():
        raise FileNotFoundError(f"no gate named {name!r} in {gate_dir(model)}: train it first (`kvprob train-gate`)")
    path = gate_dir(model) / "default.json"
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"gate": name}) + "\n")
    os.replace(tmp, path)
    return path


def default_gate(model) -> str:
    """The name of ``model``'s default gate: the one ``set_default`` recorded, else ``DEFAULT_GATE``."""
    path = gate_dir(model) / "default.json"
    return json.loads(path.read_text())["gate"] if path.exists() else DEFAULT_GATE


_LOADED: dict[tuple[str, int], list[FastKVzipGate]] = {}  # (gate file, its mtime in ns) -> its gates
_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> model_key(model)


def load(model, gate: str | None = None) -> tuple[str, list[FastKVzipGate]]:
    """(name, gates) of the gate ``gate`` of ``model``: a name in ``gate_dir(model)`` or a file's path; None: the
    model's default (``default_gate``). Read once per process and file. A missing gate raises, naming
    ``kvprob train-gate`` and its time."""
    if model not in _KEYS:
        _KEYS[model] = model_key(model)
    folder = cache_dir() / "gates" / _KEYS[model]
    name = gate if gate is not None else default_gate(model)
    path = Path(name) if name.endswith(".pt") else folder / f"{name}.pt"
    if not path.exists():
        raise FileNotFoundError(
            f"no gate {name!r} for this model in {folder}: train it with `kvprob train-gate "
            f"--model {model.config.name_or_path}` ({TRAIN_TIME}), or pass gates=... (FastKVzipPress's format)")
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = load_gates(path)
    return path.stem, _LOADED[key]


def fit(model, contexts: list[torch.Tensor], corpus: str, settings: TrainSettings | None = None,
        progress: bool = True) -> tuple[Path, dict]:
    """Labels (cached), inputs and training on ``contexts`` (a list of (1, n) ids), the corpus named ``corpus``;
    the gate is written to ``gate_path(model, gate_name(corpus, settings))`` unless it is there already
    (``settings`` None: ``TrainSettings()``). Returns its path and the record (label and training seconds)."""
    settings = TrainSettings() if settings is None else settings
    path = gate_path(model, gate_name(corpus, settings))
    digests = [_ids_digest(c) for c in contexts]
    if path.exists():
        meta = torch.load(path, weights_only=True)["meta"]
        if meta.get("context_digests", digests) != digests:
            raise ValueError(f"the gate {path.name} was trained on other contexts than the corpus {corpus!r} gives "
                             f"now: name the corpus by what defines it")
        return path, meta
    t0 = time.perf_counter()
    labels = [kvzip_labels(model, ids) for ids in tqdm(contexts, desc="KVzip labels", disable=not progress)]
    label_s = time.perf_counter() - t0
    inputs = [attention_inputs(model, ids) for ids in contexts]
    gates, record = train_gates(model, inputs, labels, settings, progress)
    meta = {"corpus": corpus, "contexts": len(contexts), "context_digests": digests, "label_seconds": label_s,
            **record, "settings": asdict(settings)}
    save_gates(gates, path, meta)
    return path, meta


__all__ = ["DEFAULT_CORPUS", "DEFAULT_GATE", "TrainSettings", "attention_inputs", "default_gate", "fit", "gate_dir",
           "gate_name", "gate_path", "gate_scores", "gates_from_state_dicts", "kept_recall", "kvzip_labels", "load",
           "load_gates", "model_key", "new_gates", "save_gates", "set_default", "train_gates"]
