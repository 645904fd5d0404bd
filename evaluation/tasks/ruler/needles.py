"""Where a needle sits in a tokenised context: the positions of the tokens that spell each value."""

from __future__ import annotations

import torch


def needle_positions(tokenizer, context_ids: torch.Tensor, values: list[str]) -> list[list[int]]:
    """For each needle value, the positions of the context tokens that spell it (every occurrence;
    empty if the value is not in the context)."""
    pieces = [tokenizer.decode([int(t)]) for t in context_ids[0]]
    starts, text = [], ""
    for piece in pieces:
        starts.append(len(text))
        text += piece
    ends = [s + len(p) for s, p in zip(starts, pieces)]
    found = []
    for value in values:
        positions, at = [], text.find(value)
        while at >= 0:
            positions += [i for i, (s, e) in enumerate(zip(starts, ends)) if s < at + len(value) and e > at]
            at = text.find(value, at + 1)
        found.append(sorted(set(positions)))
    return found
