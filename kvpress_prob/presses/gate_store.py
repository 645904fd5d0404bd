"""Fast KVzip's gates on disk: their names, their files, the model's default gate, and loading.

A gate is stored in kvpress's ``FastKVzipPress`` format, ``{"module": [state dict per layer], "meta": {...}}``, in
``gate_dir(model)`` (``$KVPROB_CACHE/gates/<model_key>``, ``artefacts.model_dir``), in a file named by what
defines it (``gate_name``: the training corpus's name and the settings). A gate press loads the gate it is given
by name (``load``), else the model's default: the one ``set_default`` recorded (``kvprob train-gate
--set-default``), else ``DEFAULT_GATE``; never a gate because it is the newest. A gate is read once per process.
Training (``kvpress_prob.learned``) writes the gates this module reads.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from kvpress.presses.fastkvzip_press import FastKVzipGate

from kvpress_prob.models import cache_dir
from kvpress_prob.presses.artefacts import model_dir, model_key

VERSION = 2  # of the label and training rules (kvpress_prob.learned): a change renames every gate


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


def gate_dir(model) -> Path:
    """Where the labels and gates of ``model`` are cached: ``$KVPROB_CACHE/gates/<model_key>``."""
    return model_dir(model)


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


__all__ = ["DEFAULT_CORPUS", "DEFAULT_GATE", "TRAIN_TIME", "TrainSettings", "VERSION", "default_gate", "gate_dir",
           "gate_name", "gate_path", "gates_from_state_dicts", "load", "load_gates", "save_gates", "set_default"]
