"""Fast KVzip's gates on disk: their names, their files, the model's default gate, and loading.

A gate is a safetensors file (``artefacts.save``): tensor ``<layer>.<name>`` is entry ``<name>`` of the state
dict of that layer's ``FastKVzipGate``, and the metadata records the model it was trained for (``model_key``,
``shapes``), its settings, its corpus and the command that trains it. It is named by what defines it
(``gate_name``: the training corpus's name and the settings) and found in the user's cache
(``artefacts.model_dir``), else among the package's files (``artefacts.PACKAGE_DIR``: the embedded model's
default gate ships there, stored in 16 bits and read as float32). A gate press loads the gate it is given by name
or path (``load``), else the model's default: the one ``set_default`` recorded (``kvprob train-gate
--set-default``), else ``DEFAULT_GATE``; never a gate because it is the newest. Loading refuses a gate of another
model (``artefacts.check_model``) or of other shapes. A file in kvpress's ``FastKVzipPress`` format (``.pt``, a
list of per-layer state dicts) loads by path, checked on its shapes alone unless it records a ``model_key``. A
gate is read once per process. Training (``kvpress_prob.learned``) writes the gates this module reads.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from kvpress.presses.fastkvzip_press import FastKVzipGate

from kvpress_prob.presses import artefacts

VERSION = 3  # of the label and training rules (kvpress_prob.learned): a change renames every gate


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


def state_dicts(gates: list[FastKVzipGate], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors of a gate file: ``<layer>.<name>`` for every entry of every layer's state dict, in ``dtype``."""
    return {f"{i}.{k}": v.detach().to("cpu", dtype) for i, g in enumerate(gates) for k, v in g.state_dict().items()}


def save_gates(gates: list[FastKVzipGate], path: Path, meta: dict, dtype: torch.dtype = torch.float32) -> None:
    """Write ``gates`` (stored in ``dtype``) with ``meta`` to the safetensors file ``path``, atomically."""
    artefacts.save(path, state_dicts(gates, dtype), {**meta, "kind": "gate", "dtype": str(dtype).split(".")[-1]})


def read_gates(path: Path) -> tuple[list[FastKVzipGate], dict]:
    """(float32 gates, metadata) of a gate file: safetensors (this module's), or ``.pt`` in ``FastKVzipPress``'s
    format (a dict with ``"module"``, or the list itself; its ``"meta"``, if any, as the metadata)."""
    path = Path(path)
    if path.suffix == ".pt":
        saved = torch.load(path, weights_only=True)
        layers, meta = (saved["module"], saved.get("meta", {})) if isinstance(saved, dict) else (saved, {})
    else:
        tensors, meta = artefacts.read(path)
        layers = [{} for _ in range(1 + max(int(k.split(".", 1)[0]) for k in tensors if k[0].isdigit()))]
        for name, value in tensors.items():
            if name[0].isdigit():
                index, key = name.split(".", 1)
                layers[int(index)][key] = value
    return gates_from_state_dicts([{k: v.float() for k, v in layer.items()} for layer in layers]), meta


def load_gates(path: Path) -> list[FastKVzipGate]:
    """The float32 gates of a gate file (``read_gates``), unchecked: what ``GatePress(gates=...)`` takes."""
    return read_gates(path)[0]


def check_gates(model, gates: list[FastKVzipGate], meta: dict, source, key: str | None = None) -> None:
    """Refuse gates that do not fit ``model``: one per layer, scoring its KV heads from its hidden size with its
    group size; and, when ``meta`` records a model (every gate this package writes does), that model
    (``artefacts.check_model``)."""
    config = model.config
    expected = (config.num_hidden_layers, config.num_key_value_heads,
                config.num_attention_heads // config.num_key_value_heads, config.hidden_size)
    found = [(len(gates), g.nhead, g.ngroup, g.q_proj.in_features) for g in gates] or [(0, None, None, None)]
    wrong = [f for f in found if f != expected]
    if wrong:
        raise ValueError(f"the gate {source} does not fit this model: (layers, KV heads, group size, input width) "
                         f"{wrong[0]}, the model's {expected}")
    if "model_key" in meta or Path(str(source)).suffix != ".pt":
        artefacts.check_model(model, meta, source, "gate", key)


def gate_name(corpus: str, settings: TrainSettings) -> str:
    """The name of the gate trained on the corpus named ``corpus`` with ``settings``: what defines it, spelled out
    (the model is its folder, ``artefacts.model_dir``)."""
    s = settings
    return (f"{corpus}-steps{s.steps}-batch{s.batch_size}-lr{s.lr:g}-dim{s.output_dim}-sink{s.sink}-pin{s.n_sink}"
            f"-seed{s.seed}-v{VERSION}")


#: The corpus ``kvprob train-gate`` trains on by default: the first 1024 tokens of 20 prose development windows and
#: 10 development RULER haystacks (``evaluation.tasks.prose.gate.contexts``).
DEFAULT_CORPUS = "dev-prose20-ruler10-1024"
#: The gate a gate press loads when none is named and the model has no default set (``set_default``); the
#: embedded model's ships with the package.
DEFAULT_GATE = gate_name(DEFAULT_CORPUS, TrainSettings())
#: The file suffix of a gate.
SUFFIX = ".safetensors"
#: What training the default gate costs (results/gate/), for the error that asks for it.
TRAIN_TIME = ("about 8 minutes on one CPU thread for SmolLM2-135M: 6 for KVzip's labels of 30 contexts, 1.5 for "
              "training")


def gate_path(model, name: str) -> Path:
    """The file of the gate named ``name`` (``gate_name``) of ``model`` in the user's cache."""
    return artefacts.model_dir(model) / f"{name}{SUFFIX}"


def set_default(model, name: str) -> Path:
    """Make the gate ``name`` (in the user's cache or the package's files) the default of ``model``: what a gate
    press built by name loads. Returns the file recording it."""
    if artefacts.find(model, f"{name}{SUFFIX}") is None:
        raise FileNotFoundError(f"no gate named {name!r} for this model in {artefacts.model_dir(model)} or the "
                                f"package: train it first (`kvprob train-gate`)")
    path = artefacts.model_dir(model) / "default.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"gate": name}) + "\n")
    os.replace(tmp, path)
    return path


def default_gate(model, key: str | None = None) -> str:
    """The name of ``model``'s default gate: the one ``set_default`` recorded, else ``DEFAULT_GATE``."""
    path = artefacts.model_dir(model, key) / "default.json"
    return json.loads(path.read_text())["gate"] if path.exists() else DEFAULT_GATE


_LOADED: dict[tuple[str, int], tuple[list[FastKVzipGate], dict]] = {}  # (file, its mtime in ns) -> gates, metadata
_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> artefacts.model_key(model)


def load(model, gate: str | None = None) -> tuple[str, list[FastKVzipGate]]:
    """(name, float32 gates) of the gate ``gate`` of ``model``: a name (found by ``artefacts.find``: the user's
    cache, then the package's files) or a file's path (``.safetensors``, or ``.pt`` in ``FastKVzipPress``'s
    format); None: the model's default (``default_gate``). Read once per process and file; checked against the
    model at every load (``check_gates``). A missing gate raises, naming ``kvprob train-gate`` and its time."""
    if model not in _KEYS:
        _KEYS[model] = artefacts.model_key(model)
    key = _KEYS[model]
    name = gate if gate is not None else default_gate(model, key)
    if name.endswith((SUFFIX, ".pt")):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"no gate file {name}")
    else:
        path = artefacts.find(model, f"{name}{SUFFIX}", key)
        if path is None:
            raise FileNotFoundError(
                f"no gate {name!r} for this model ({key}) in {artefacts.model_dir(model, key)} or the package: train "
                f"it with `kvprob train-gate --model {model.config.name_or_path}` ({TRAIN_TIME}), or pass gates=... "
                f"(FastKVzipPress's format)")
    cached = (str(path.resolve()), path.stat().st_mtime_ns)
    if cached not in _LOADED:
        _LOADED[cached] = read_gates(path)
    gates, meta = _LOADED[cached]
    check_gates(model, gates, meta, path, key)
    return path.name.removesuffix(SUFFIX).removesuffix(".pt"), gates


__all__ = ["DEFAULT_CORPUS", "DEFAULT_GATE", "SUFFIX", "TRAIN_TIME", "TrainSettings", "VERSION", "check_gates",
           "default_gate", "gate_name", "gate_path", "gates_from_state_dicts", "load", "load_gates", "read_gates",
           "save_gates", "set_default", "state_dicts"]
