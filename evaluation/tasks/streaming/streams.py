"""Token streams for the streaming benchmark (docs/research/README.md): the essays of one split of
``evaluation.tasks.prose.essays`` (its split, by essay), cut or joined into streams of ``n`` tokens.

- An essay of at least ``n`` tokens gives ``len // n`` streams of its own, tiling it from its first token.
- The shorter essays are joined in name order, two newlines between them, into streams of ``n`` tokens;
  the part of the last joined essay beyond ``n`` tokens is dropped, and so is a final group shorter
  than ``n``.

Streams never overlap and never share an essay's token. They are ordered by tile (every essay's first
stream, in the name order of the essay that ends it, then every second tile, ...), so that the first k
streams come from as many different essays as possible.

    streams(tokenizer, "dev", 4096)       -> [Stream, ...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evaluation.tasks.prose.essays import SPLITS, essay_ids, essays

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Stream:
    """One stream: ``stream_id`` ("avg:0", "copy+desres:0"), the essays it holds (file stems) and ``ids``
    (1, n) int64."""

    stream_id: str
    essays: tuple[str, ...]
    ids: torch.Tensor


def streams(tokenizer, split: str, n: int, max_streams: int | None = None) -> list[Stream]:
    """The streams of ``n`` tokens of ``split`` ("dev" or "test"), the first ``max_streams`` (None: all)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n (tokens per stream) must be an integer >= 2, got {n!r}")
    if max_streams is not None and (not isinstance(max_streams, int) or max_streams < 1):
        raise ValueError(f"max_streams must be an integer >= 1 or None, got {max_streams!r}")
    separator = list(tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"])
    tiles: list[tuple[int, int, Stream]] = []  # (tile index, group order, stream)
    group: list[str] = []
    pending: list[int] = []
    for order, path in enumerate(essays(split)):
        ids = essay_ids(tokenizer, path)
        if len(ids) >= n:
            for k in range(len(ids) // n):
                tiles.append((k, order, _stream((path.stem,), k, ids[k * n:(k + 1) * n])))
            continue
        pending += (separator if pending else []) + ids
        group.append(path.stem)
        if len(pending) >= n:
            tiles.append((0, order, _stream(tuple(group), 0, pending[:n])))
            group, pending = [], []
    out = [s for _, _, s in sorted(tiles, key=lambda t: (t[0], t[1]))]
    return out if max_streams is None else out[:max_streams]


def _stream(names: tuple[str, ...], tile: int, ids: list[int]) -> Stream:
    return Stream(f"{'+'.join(names)}:{tile}", names, torch.tensor(ids, dtype=torch.long)[None])
