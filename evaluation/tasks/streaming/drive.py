"""Feeding one stream through a model in chunks under a press, as a kvpress user decodes: one forward
per chunk on the same ``DynamicCache``, ``position_ids`` counting the stream's tokens (the cache may hold
fewer entries than that: kvpress's pipeline passes the positions the same way), inside
``with press(model):`` for the whole stream.

The schedule of a (stream length n, budget, chunk, interval) setting (docs/research/README.md, "Protocol"):

- prefill: the first ``budget`` tokens in one forward (a DecodingPress leaves a prefill alone, and the
  cache then holds exactly the budget);
- then whole chunks of ``chunk`` tokens while they fit before the last token (which is only a target;
  a tail shorter than a chunk is not fed, so every forward has the same length); a press
  compresses every ``interval`` tokens, that is every ``interval // chunk`` forwards, which is how
  kvpress's ``DecodingPress`` counts its ``compression_interval`` (one step per forward, whatever its
  length);
- the first compression ends the forward of tokens budget + interval - 1; every prediction from
  position ``score_from = budget + interval`` on is scored.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from kvpress_prob.cache import cache_held_bytes, widest_held


@dataclass(frozen=True)
class Schedule:
    """The feeding schedule of one setting (module docstring)."""

    n: int
    budget: int
    chunk: int
    interval: int

    def __post_init__(self):
        for name in ("n", "budget", "chunk", "interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.interval % self.chunk:
            raise ValueError(f"interval ({self.interval}) must be a multiple of chunk ({self.chunk}): a press "
                             "compresses after a whole number of forwards")
        if self.score_from >= self.end:
            raise ValueError(f"budget + interval ({self.score_from}) must leave a whole chunk before the stream's "
                             f"last token ({self.n - 1}): no token would be scored")

    @property
    def prefill(self) -> int:
        return self.budget

    @property
    def score_from(self) -> int:
        return self.budget + self.interval

    @property
    def end(self) -> int:
        """One past the last token fed: the prefill plus every whole chunk before token n - 1."""
        return self.prefill + (self.n - 1 - self.prefill) // self.chunk * self.chunk

    @property
    def calls_per_interval(self) -> int:
        """Forwards between two compressions: a DecodingPress's ``compression_interval``."""
        return self.interval // self.chunk


@torch.inference_mode()
def feed(model, ids: torch.Tensor, schedule: Schedule, press=None,
         on_logits: Callable[[int, torch.Tensor], None] | None = None) -> dict:
    """Feed ``ids`` (1, n) by ``schedule`` under ``press`` (None: the full cache). ``on_logits(start, logits)``
    gets the float32 logits (k, V) of positions start..start + k - 1 >= ``score_from`` after each forward.
    Returns the cache's size: ``held_max`` (the most entries per KV head any layer held after a forward),
    ``attended_max`` (the most any forward attended: entries before it plus its tokens), ``held_end`` (the
    most after the last forward), ``kv_bytes`` (keys and values of the final cache), ``bias_bytes`` (the
    bias a press keeps on it: a dense layer's correction, a ragged layer's own), both counting each storage once
    (``kvpress_prob.cache.held_bytes``) and measured before the press's context exits, ``budget_bytes`` (keys
    and values of ``budget`` entries per KV head in every layer: the equal-bytes target, whatever each
    layer holds) and ``cache`` (the final DynamicCache)."""
    if ids.shape != (1, schedule.n):
        raise ValueError(f"ids must have shape (1, {schedule.n}), got {tuple(ids.shape)}")
    ids = ids.to(model.device)
    cache = DynamicCache()
    held_max = attended_max = 0

    def forward(start: int, end: int, keep_all: bool):
        nonlocal held_max, attended_max
        before = _held(cache)  # the widest head of any layer (a ragged layer's is not its logical length)
        positions = torch.arange(start, end, device=ids.device)[None]
        out = model(input_ids=ids[:, start:end], past_key_values=cache, position_ids=positions,
                    logits_to_keep=0 if keep_all else 1)
        held = _held(cache)
        held_max, attended_max = max(held_max, held), max(attended_max, before + end - start)
        return out.logits[0]

    with press(model) if press is not None else nullcontext():
        forward(0, schedule.prefill, keep_all=False)
        for start in range(schedule.prefill, schedule.end, schedule.chunk):
            end = start + schedule.chunk
            logits = forward(start, end, keep_all=True)
            if end > schedule.score_from and on_logits is not None:
                first = max(start, schedule.score_from)
                on_logits(first, logits[first - start:].float())
        kv_bytes, bias_bytes = cache_held_bytes(cache)
    held_end = _held(cache)
    budget_bytes = sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.dtype.itemsize * schedule.budget
                       for layer in cache.layers)
    return {"held_max": held_max, "attended_max": attended_max, "held_end": held_end, "kv_bytes": kv_bytes,
            "bias_bytes": bias_bytes, "budget_bytes": budget_bytes, "cache": cache}


def _held(cache) -> int:
    """Entries the widest KV head of any layer of ``cache`` holds (a ragged head: its kept count plus the appended
    tokens); 0 before the first forward."""
    return max((widest_held(layer) for layer in cache.layers if layer.is_initialized), default=0)


def full_logits(model, ids: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """The full cache's logits (end - score_from, V) float32 at every scored position, fed by the same
    schedule (so a press that never evicts scores exactly 0)."""
    rows: list[torch.Tensor] = []
    feed(model, ids, schedule, None, lambda start, logits: rows.append(logits))
    return torch.cat(rows)
