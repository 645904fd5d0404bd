"""The offline RULER tasks other than needle in a haystack: variable tracking (vt), common words
(cwe) and frequent words (fwe), after RULER's variable_tracking.py and common/freq_words_extraction.py
(docs/protocol.md). ``evaluation.tasks.ruler.offline`` generates and caches the frames."""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Sequence

from evaluation.tasks.ruler.text import (
    CWE_TEMPLATE,
    FWE_TEMPLATE,
    NOISE,
    VT_TEMPLATE,
    Example,
    _insert_at_random_lines,
    split_prompt,
    word_list,
)



def _vt_chain(rng: random.Random, num_hops: int, name_len: int) -> tuple[list[str], list[str], str]:
    """(variable names, chain lines, value) of one chain ``VAR A = 12345``, ``VAR B = VAR A``, ..."""
    names = _distinct_names(rng, num_hops + 1, name_len)
    value = str(rng.randint(10000, 99999))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(num_hops)]
    return names, lines, value


def _distinct_names(rng: random.Random, n: int, length: int) -> list[str]:
    """``n`` distinct random upper-case names of ``length`` letters."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        if name not in names:
            names.append(name)
    return names


def _vt_prompt(rng: random.Random, size: int, num_hops: int, name_len: int) -> tuple[str, list[str]]:
    """Full variable-tracking prompt over ``size`` noise lines, and its answer (the chain's names)."""
    names, chain, value = _vt_chain(rng, num_hops, name_len)
    context = "\n".join(_insert_at_random_lines(rng, [NOISE] * size, chain))
    return VT_TEMPLATE.format(context=context, query=value, num_v=num_hops + 1), names


def _vt_builder(context_length: int, num_hops: int = 4) -> Callable[[random.Random, int], Example]:
    """Builder of variable tracking (RULER variable_tracking.py: one chain of 4 hops, noise haystack)."""
    icl_lines = min(12, context_length // 256)

    def build(rng: random.Random, size: int) -> Example:
        icl_text, icl_names = _vt_prompt(rng, icl_lines, num_hops, name_len=3)
        text, names = _vt_prompt(rng, size, num_hops, name_len=5)
        text = icl_text + " ".join(icl_names) + "\n\n" + text
        return Example(*split_prompt("vt", text), names)

    return build


def _cwe_list(rng: random.Random, vocab: Sequence[str], n_words: int, common: int, uncommon: int):
    """Numbered list ``1. w 2. w ...`` of ``n_words`` words, the first 10 repeated ``common`` times."""
    words = rng.sample(list(vocab), n_words)
    top, rest = words[:10], words[10:]
    entries = top * common + rest * uncommon
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)), top


def _cwe_builder(context_length: int) -> Callable[[random.Random, int], Example]:
    """Builder of common words extraction (RULER common_words_extraction.py); size = distinct words."""
    vocab = sorted(set(word_list("noun") + word_list("adjective") + word_list("verb")))
    if context_length >= 4096:  # RULER's setting at 4096 and above
        shot, (common, uncommon) = (40, 10, 3), (30, 3)
    else:  # RULER's setting below 4096; below 1024 the few-shot example does not fit
        shot, (common, uncommon) = ((20, 3, 1) if context_length >= 1024 else None), (6, 1)

    def build(rng: random.Random, size: int) -> Example:
        prefix = ""
        if shot is not None:
            shot_list, shot_top = _cwe_list(rng, vocab, *shot)
            shot_answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_top))
            prefix = CWE_TEMPLATE.format(context=shot_list) + " " + shot_answer + "\n"
        words, top = _cwe_list(rng, vocab, size, common, uncommon)
        return Example(*split_prompt("cwe", prefix + CWE_TEMPLATE.format(context=words)), top)

    return build


ZETA_2 = math.pi**2 / 6  # Riemann zeta(2): normaliser of RULER's Zipf counts with alpha = 2


def _fwe_builder(context_length: int, word_len: int = 6) -> Callable[[random.Random, int], Example]:
    """Builder of frequent words extraction (RULER freq_words_extraction.py, alpha = 2); size = word budget."""
    vocab_size = max(10, context_length // 50)

    def build(rng: random.Random, size: int) -> Example:
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent "word" is noise, as in RULER
        counts = [int(size * k**-2.0 / ZETA_2) for k in range(1, vocab_size + 1)]
        words = [w for w, c in zip(ranked, counts) for _ in range(c)]
        rng.shuffle(words)
        text = FWE_TEMPLATE.format(context=" ".join(words))
        return Example(*split_prompt("fwe", text), ranked[1:4])

    return build


