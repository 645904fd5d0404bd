"""Recall windows and their cued sentences (docs/protocol.md, "Recall split").

Essays and split are the prose benchmark's (``evaluation.tasks.prose.essays``: by essay, sha256 of the
file name). A window is ``n`` consecutive tokens of one essay (tiled from its first token, no
overlap, the tail dropped). A sentence of the window starts at token i >= 1 when token i - 1 ends
(spaces stripped) with ".", "!" or "?" (or holds a newline) and token i starts with an upper-case
letter after optional spaces; it ends at the first later token ending with ".", "!" or "?". It is
eligible when it lies wholly in the window and has between ``cue_tokens + 4`` and 64 tokens. The
window is cut into ``sentences`` equal parts and each part gives its first eligible sentence starting
in it (a part without one gives none; a window without any cue is skipped).

A cue is the text "\\n\\n" + the sentence (decoded, stripped) under the tokenizer: its first
``len("\\n\\n" tokens) + cue_tokens`` tokens are fed, the next ones (at most ``scored``) are the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evaluation.tasks.prose.essays import essay_ids, essays

ENDS = (".", "!", "?")
MAX_SENTENCE = 64


@dataclass(frozen=True)
class Cue:
    """One cued sentence: ``start`` (its first token's position in the window), ``cue`` (1, C) fed
    before the targets, ``targets`` (T,) the sentence's next tokens."""

    start: int
    cue: torch.Tensor
    targets: torch.Tensor


@dataclass(frozen=True)
class RecallWindow:
    """``essay`` (file stem), ``index`` within the essay, ``ids`` (1, n) the context, ``cues``."""

    essay: str
    index: int
    ids: torch.Tensor
    cues: tuple[Cue, ...]

    @property
    def window_id(self) -> str:
        return f"{self.essay}:{self.index}"


def sentence_spans(pieces: list[str], cue_tokens: int) -> list[tuple[int, int]]:
    """(first, last) token indices of the eligible sentences of a window whose tokens decode to ``pieces``."""
    spans = []
    for i in range(1, len(pieces)):
        before, text = pieces[i - 1], pieces[i]
        if not (before.rstrip().endswith(ENDS) or "\n" in before) or not text.lstrip(" ")[:1].isupper():
            continue
        end = next((j for j in range(i + 1, min(len(pieces), i + MAX_SENTENCE)) if pieces[j].rstrip().endswith(ENDS)), None)
        if end is not None and end - i + 1 >= cue_tokens + 4 and "\n" not in "".join(pieces[i:end + 1]).strip():
            spans.append((i, end))
    return spans


def window_cues(tokenizer, ids: list[int], sentences: int, cue_tokens: int, scored: int) -> tuple[Cue, ...]:
    """The cues of one window of token ids ``ids``: the first eligible sentence of each of ``sentences``
    equal parts."""
    if sentences < 1 or cue_tokens < 1 or scored < 1:
        raise ValueError(f"sentences, cue_tokens and scored must be >= 1, got {sentences}, {cue_tokens}, {scored}")
    pieces = [tokenizer.decode([t]) for t in ids]
    spans = sentence_spans(pieces, cue_tokens)
    blank = len(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    n, cues = len(ids), []
    for part in range(sentences):
        lo, hi = part * n // sentences, (part + 1) * n // sentences
        span = next(((i, j) for i, j in spans if lo <= i < hi), None)
        if span is None:
            continue
        text = tokenizer.decode(ids[span[0] : span[1] + 1]).strip()
        tokens = tokenizer("\n\n" + text, add_special_tokens=False)["input_ids"]
        fed, targets = tokens[: blank + cue_tokens], tokens[blank + cue_tokens : blank + cue_tokens + scored]
        if len(targets) >= 2:
            cues.append(Cue(span[0], torch.tensor(fed, dtype=torch.long)[None], torch.tensor(targets, dtype=torch.long)))
    return tuple(cues)


def windows(tokenizer, n: int, split: str, sentences: int, cue_tokens: int, scored: int,
            max_per_essay: int | None = None) -> list[RecallWindow]:
    """Every window of the essays of ``split`` with at least one cue (essays in name order, windows in
    text order), at most ``max_per_essay`` per essay (the first ones)."""
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n (context tokens) must be an integer >= 2, got {n!r}")
    if max_per_essay is not None and max_per_essay < 1:
        raise ValueError(f"max_per_essay must be >= 1 or None, got {max_per_essay!r}")
    out = []
    for path in essays(split):
        ids = essay_ids(tokenizer, path)
        for k in range(len(ids) // n):
            if max_per_essay is not None and k >= max_per_essay:
                break
            chunk = ids[k * n : (k + 1) * n]
            cues = window_cues(tokenizer, chunk, sentences, cue_tokens, scored)
            if cues:
                out.append(RecallWindow(path.stem, k, torch.tensor(chunk, dtype=torch.long)[None], cues))
    return out


def order(found: list[RecallWindow], max_windows: int | None = None) -> list[RecallWindow]:
    """Every essay's first window, then every essay's second, ..., cut at ``max_windows`` (None: all)."""
    ranked = sorted(found, key=lambda w: (w.index, w.essay))
    return ranked if max_windows is None else ranked[:max_windows]
