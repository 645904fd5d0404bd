"""Shared helpers of the benchmarks: machine description, contexts, output files, plotting."""

from __future__ import annotations

import io
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from evaluation.report import markdown_table
from evaluation.store import write_atomic

__all__ = [
    "machine_info",
    "load",
    "context_ids",
    "write_json",
    "write_markdown",
    "save_figure",
    "markdown_table",
    "Stopwatch",
]


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


def machine_info() -> dict:
    """Platform, CPU count, library versions and the torch thread setting."""
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    try:
        kvpress_version = version("kvpress")
    except PackageNotFoundError:  # pragma: no cover
        kvpress_version = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpress": kvpress_version,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.cuda.is_available(),
        "loadavg_start": loadavg(),
    }


def load(model_name: str | None):
    """(model, tokenizer) through ``kvpress_prob.load_model`` (None / 'embedded' = SmolLM2-135M)."""
    from kvpress_prob import load_model

    return load_model(model_name)


def context_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """Exactly ``length`` token ids (1, length) of a RULER context (repeated if it comes out short)."""
    from evaluation.datasets.ruler import generate_ruler

    df = generate_ruler(tokenizer, length, 1, seed)
    ids = tokenizer(df.context.iloc[0], add_special_tokens=False).input_ids
    if not ids:
        raise RuntimeError("empty RULER context")
    while len(ids) < length:
        ids = ids + ids
    return torch.tensor(ids[:length])[None]


def _plain(obj):
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, torch.Tensor):
        return _plain(obj.tolist())
    if isinstance(obj, pd.DataFrame):
        plain_index = isinstance(obj.index, pd.RangeIndex) and obj.index.name is None
        return _plain((obj if plain_index else obj.reset_index()).to_dict(orient="records"))
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    return obj


def write_json(path: Path, data: dict) -> Path:
    return write_atomic(path, json.dumps(_plain(data), indent=1, allow_nan=False) + "\n")


def write_markdown(path: Path, text: str) -> Path:
    return write_atomic(path, text)


def save_figure(fig: Figure, path: Path) -> Path:
    """Render with the Agg canvas (no pyplot state) and write atomically."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return write_atomic(path, buffer.getvalue())


class Stopwatch:
    """Wall-clock and process CPU time of a block."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        return False


def machine_markdown(info: dict) -> str:
    keys = ["platform", "processor", "cpu_count", "torch", "transformers", "kvpress", "torch_threads",
            "loadavg_start", "loadavg_end"]
    lines = [f"- {k}: {info.get(k)}" for k in keys if k in info]
    return "\n".join(lines) + "\n"
