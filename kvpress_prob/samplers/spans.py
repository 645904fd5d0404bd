"""Span-aware units: blocks whose boundaries follow the tokenizer's words, kept spans widened.

Fixed blocks (``samplers.block.BlockSampler``) cut the prefix every ``size`` positions, so a number
the tokenizer splits digit by digit can straddle two blocks and lose half of its digits. Here a
unit is a run of whole words (a word starts at a token that begins with whitespace, or at a
special token; digits, punctuation and word pieces stay with the word they follow), packed
greedily up to ``size`` tokens (a longer word is cut every ``size`` tokens). A kept unit is widened
by ``widen`` tokens on each side, so the token before it (the space before a number, the end of
the previous word) survives too. The widened tokens count against the budget: every head keeps at
most int((1 - r) n) tokens in all, units included in order until the next one would not fit, and
keeps exactly the tokens it charged. Widening is top-k only.

The press learns the token ids of its prefill without leaving state behind: ``SpanPress`` hooks
the model's input embedding inside its own ``with press(model):`` block only (the hook and the ids
are gone on exit), and an engine that replays a recorded prefill binds them with
``with press.tokens(context_ids):`` around ``evict``. The word boundaries come from the tokenizer
given to the press, or the model's own (``model.config._name_or_path``), loaded once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress_prob.samplers.base import Draw, Sampler, check_ratio

#: the first characters of a token that starts a new word (byte-level BPE and SentencePiece markers)
WORD_STARTS = ("Ġ", "Ċ", "ĉ", "▁", " ", "\n", "\t")
INNERS = ("topk", "priority")


def word_starts(tokenizer, ids: list[int]) -> list[bool]:
    """Whether each token starts a word: it begins with whitespace, or it or its predecessor is a
    special token. The first token always starts one."""
    tokens = tokenizer.convert_ids_to_tokens(ids)
    special = set(tokenizer.all_special_ids)
    starts = []
    for i, (token, token_id) in enumerate(zip(tokens, ids)):
        starts.append(i == 0 or token_id in special or ids[i - 1] in special or str(token).startswith(WORD_STARTS))
    return starts


def pack_units(starts: list[bool], size: int) -> torch.Tensor:
    """Unit index of each position (n,) long: whole words packed greedily up to ``size`` tokens,
    a word longer than ``size`` cut every ``size`` tokens (its last piece shares a unit with what
    follows when it fits). Units are contiguous and numbered 0, 1, ..."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    words, current = [], 0  # lengths of the words
    for i, start in enumerate(starts):
        if start and i > 0:
            words.append(current)
            current = 0
        current += 1
    if starts:
        words.append(current)
    unit_of, unit, filled = [], -1, size
    for length in words:
        if filled + length > size:  # open a new unit
            unit, filled = unit + 1, 0
        for _ in range(length):
            if filled == size:  # a word longer than size: cut it
                unit, filled = unit + 1, 0
            unit_of.append(unit)
            filled += 1
    return torch.tensor(unit_of, dtype=torch.long)


def greedy_fill(order: list[int], starts: list[int], ends: list[int], capacity: int, widen: int
                ) -> tuple[list[int], int, bytearray]:
    """Units taken in ``order`` while the union of their widened spans fits in ``capacity`` tokens.

    Unit u covers [starts[u], ends[u]) and, widened, ``widen`` more tokens each side. Returns (the
    units taken, the index in ``order`` of the first unit that did not fit, len(order) if none, and
    the covered positions (n,) as bytes: exactly what is kept, and what was charged)."""
    n = ends[-1]
    covered = bytearray(n)
    used, taken = 0, []
    for position, u in enumerate(order):
        lo, hi = max(0, starts[u] - widen), min(n, ends[u] + widen)
        new = hi - lo - sum(covered[lo:hi])
        if used + new > capacity:
            return taken, position, covered
        covered[lo:hi] = b"\x01" * (hi - lo)
        used += new
        taken.append(u)
    return taken, len(order), covered


@dataclass(kw_only=True)
class SpanSampler(Sampler):
    """Top-k or priority sampling over span-aware units (beyond the paper; module docstring).

    A unit's proposal is the sum of its positions' pi. ``inner="topk"`` takes units by that sum,
    ``inner="priority"`` by the priority pi_u / u_u with u_u ~ U(0, 1] (Duffield, Lund and Thorup
    2007), both until the head's budget of int((1 - r) n) tokens, widening included, is full: the
    kept tokens are exactly the tokens charged. Top-k keeps weight 1. Priority keeps unit u with
    weight max(pi_u, t) / pi_u, t the priority of the first unit that did not fit (0 if all fit):
    given the other units' priorities, u is kept exactly when its priority exceeds a threshold that
    is then t, so E[w_u 1{u kept}] = 1 for units of any sizes that fit the budget (a longer unit is
    refused at eviction: it could never be kept).

    Priority sampling refuses ``widen`` > 0: a widened token is kept when its own unit or a
    neighbour is, and the probability of that union under a token budget shared by neighbours has no
    closed form (its product form 1 - prod_u (1 - p_u) assumed independent units and was biased by up
    to 4 % per token, z = 45 in 200k draws); a unit whose widened span cannot fit would also be
    given a probability above 0.

    The units are bound by ``SpanPress`` for the duration of its ``evict`` (``units``); the budget
    scope must be "head".

    Parameters
    ----------
    inner : {"topk", "priority"}, default "topk"
        How units are chosen.
    widen : int, default 1
        Tokens kept on each side of a kept unit, >= 0; 0 with "priority".
    """

    inner: str = "topk"
    widen: int = 1
    units: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.inner not in INNERS:
            raise ValueError(f"inner must be one of {INNERS}, got {self.inner!r}")
        if self.widen < 0:
            raise ValueError(f"widen must be >= 0, got {self.widen}")
        if self.inner == "priority" and self.widen > 0:
            raise ValueError(
                f"widen must be 0 with inner='priority', got {self.widen}: the inclusion probability of a token "
                f"that a kept neighbour's widening may also keep has no closed form, so its weight would be biased "
                f"(SpanSampler docstring); use inner='topk' to widen")
        self.random = self.inner == "priority"

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        check_ratio(compression_ratio)
        if scope != "head":
            raise ValueError(f"SpanSampler keeps a fixed count per head: the press's budget must be 'head', got {scope!r}")
        if self.units is None:
            raise RuntimeError("SpanSampler has no units: it runs inside a SpanPress, which binds them at eviction")
        L, b, H, n = pi.shape
        units = self.units.to(pi.device)
        if units.shape != (n,):
            raise ValueError(f"units must have one entry per prefix position ({n}), got shape {tuple(units.shape)}")
        count = int(units[-1]) + 1
        bounds = torch.searchsorted(units, torch.arange(count + 1, device=units.device)).tolist()
        starts, ends = bounds[:-1], bounds[1:]
        unit_pi = torch.zeros(L, b, H, count, dtype=torch.float64, device=pi.device).index_add_(
            -1, units, pi.double())  # (L, b, H, U)
        capacity = int((1.0 - compression_ratio) * n)  # tokens per head
        longest = max(e - s for s, e in zip(starts, ends))
        if self.inner == "priority" and longest > capacity:
            raise ValueError(
                f"SpanSampler(inner='priority'): a unit of {longest} tokens exceeds the head's capacity of {capacity} "
                f"tokens (compression_ratio {compression_ratio}, n = {n}); it could never be kept, and no weight "
                f"makes that unbiased: use a smaller unit size or a lower compression_ratio")
        if self.inner == "priority":
            u = 1.0 - torch.rand(unit_pi.shape, generator=generator, device=pi.device, dtype=torch.float64)
            key = unit_pi / u
        else:
            key = unit_pi
        order = key.argsort(dim=-1, descending=True, stable=True).cpu()
        key_cpu = key.cpu()
        keep = torch.zeros(L, b, H, n, dtype=torch.bool)
        threshold = torch.zeros(L, b, H, 1, dtype=torch.float64)
        for index in torch.cartesian_prod(torch.arange(L), torch.arange(b), torch.arange(H)).tolist():
            ranked = order[tuple(index)].tolist()
            _, stop, covered = greedy_fill(ranked, starts, ends, capacity, self.widen)
            keep[tuple(index)] = torch.frombuffer(covered, dtype=torch.uint8).bool()
            if stop < count:
                threshold[tuple(index)] = key_cpu[tuple(index)][ranked[stop]]
        keep, threshold = keep.to(pi.device), threshold.to(pi.device)
        if self.inner == "topk":
            log_weight = torch.where(keep, 0.0, float("-inf"))
        else:  # widen = 0: a token is kept with its unit, weight max(pi_u, t) / pi_u
            unit_log_weight = torch.log(torch.maximum(unit_pi, threshold)) - torch.log(unit_pi)  # (L, b, H, U)
            log_weight = torch.where(keep, unit_log_weight[..., units], float("-inf"))
        kept = keep.sum(-1)
        return Draw(keep=keep, log_weight=log_weight.float(),
                    stats={"units": count, "kept_per_head": kept[:, 0].tolist(), "capacity_per_head": capacity})
