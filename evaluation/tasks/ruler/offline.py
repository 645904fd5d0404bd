"""RULER synthetic tasks, generated offline with any tokenizer: each example filled to the context length, the
frame cached on disk (the task builders are in ``niah``, ``words`` and ``hub``).

The generator follows NVIDIA's RULER (``scripts/data/synthetic/*.py`` and ``constants.py``): the same
needle sentence, haystacks, word lists, templates and task configurations, then splits each prompt
into (context, question, answer_prefix) with the patterns kvpress used to build ``simonjegou/ruler``.
Differences, all forced by running offline and at small lengths:

- sentences are split with a regular expression (no nltk punkt data);
- the ``context`` column (not the whole prompt plus the generation budget) is what is filled to at
  most ``context_length`` tokens, by bisection on the haystack size of each example;
- the vt few-shot example has ``context_length // 256`` noise lines (at most 12, about RULER's
  500 tokens at 4096); cwe drops its few-shot example below 1024 tokens, where it would not fit;
- word lists keep only lower-case single words, so keys look like ``quizzical-arch-rival``.

Output frame: see ``evaluation.tasks.FRAME_COLUMNS``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from evaluation.tasks.frame import (
    FRAME_COLUMNS,
    count_tokens,
    finalize_frame,
    tokenizer_fingerprint,
)
from evaluation.tasks.ruler.hub import _load_qa_pool, _qa_builder
from evaluation.tasks.ruler.niah import NIAH_SPECS, _niah_builder
from evaluation.tasks.ruler.text import ALL_TASKS, OFFLINE_TASKS, Example
from evaluation.tasks.ruler.words import _cwe_builder, _fwe_builder, _vt_builder

MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
GENERATOR_VERSION = 1  # part of the cache key: bump when generated text changes


# ------------------------------------------------------------------------------------------------
# Filling to the target length
# ------------------------------------------------------------------------------------------------


def fit_size(n_tokens: Callable[[int], int], target: int, min_size: int, guess: int) -> int:
    """Largest haystack size ``n >= min_size`` with ``n_tokens(n) <= target``, by bracketing then bisection.

    ``guess`` only sets where the search starts. Raises ValueError when even ``min_size`` is too long.
    """
    if n_tokens(min_size) > target:
        raise ValueError(f"context_length={target} is too small: the shortest example has {n_tokens(min_size)} tokens")
    lo, hi = min_size, None  # invariant: n_tokens(lo) <= target < n_tokens(hi)
    step = max(1, guess // 64)
    if guess > lo:
        if n_tokens(guess) <= target:
            lo = guess
        else:
            hi = guess
    while hi is None:  # gallop up
        n = lo + step
        if n_tokens(n) <= target:
            lo, step = n, step * 2
        else:
            hi = n
    step = max(1, guess // 64)
    while hi - lo > 1 and hi - step > lo:  # gallop down
        n = hi - step
        if n_tokens(n) <= target:
            lo = n
            break
        hi, step = n, step * 2
    while hi - lo > 1:  # bisect
        mid = (lo + hi) // 2
        if n_tokens(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


MIN_SIZE = {"cwe": 10, "fwe": 64}  # smallest haystack: 10 common words; enough words for a strict top 3


def _generate_one(
    build: Callable[[random.Random, int], Example],
    example_seed: str,
    tokenizer: Any,
    context_length: int,
    min_size: int,
    guess: int | None,
) -> tuple[Example, int, int]:
    """(example, context tokens, haystack size) of the longest example fitting ``context_length``."""
    cache: dict[int, tuple[Example, int]] = {}

    def n_tokens(size: int) -> int:
        if size not in cache:
            example = build(random.Random(example_seed), size)  # same draws for every size
            cache[size] = (example, count_tokens(tokenizer, example.context))
        return cache[size][1]

    if guess is None:  # linear estimate from two small probes
        probe = min_size + 64
        rate = max(1e-3, (n_tokens(probe) - n_tokens(min_size)) / 64)
        guess = int(min_size + (context_length - n_tokens(min_size)) / rate)
    size = fit_size(n_tokens, context_length, min_size, max(min_size, guess))
    example, tokens = cache[size]
    return example, tokens, size


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def spread_examples(n_examples: int, tasks: Sequence[str], seed: int) -> dict[str, int]:
    """``n_examples`` spread over ``tasks`` as evenly as possible; the remainder goes to seeded tasks."""
    base, extra = divmod(n_examples, len(tasks))
    lucky = set(random.Random(f"ruler-spread/{seed}").sample(list(tasks), extra))
    return {t: base + (t in lucky) for t in tasks}


def _task_family(task: str) -> str:
    return task.split("_")[0]


def _check_tasks(tasks: Sequence[str] | None) -> list[str]:
    tasks = list(OFFLINE_TASKS if tasks is None else tasks)
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown or not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"Bad RULER tasks {tasks!r}; valid (distinct) tasks: {', '.join(ALL_TASKS)}")
    return tasks


def _builders(task: str, context_length: int, count: int, seed: int, load_fn: Callable | None) -> list[Callable]:
    """One builder per example of ``task`` (QA examples differ by question, the others by seed only)."""
    if task in NIAH_SPECS:
        return [_niah_builder(NIAH_SPECS[task])] * count
    if task == "vt":
        return [_vt_builder(context_length)] * count
    if task == "cwe":
        return [_cwe_builder(context_length)] * count
    if task == "fwe":
        return [_fwe_builder(context_length)] * count
    # the hub tasks
    pool = _load_qa_pool(task, load_fn)
    picks = random.Random(f"ruler-qa/{seed}/{task}").sample(range(len(pool.questions)), count)
    return [_qa_builder(pool, i) for i in picks]


def default_cache_dir() -> Path:
    """``$KVPROB_CACHE/ruler``, else ``$XDG_CACHE_HOME/kvpress_prob/ruler`` (``~/.cache/...``)."""
    if "KVPROB_CACHE" in os.environ:
        return Path(os.environ["KVPROB_CACHE"]) / "ruler"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpress_prob" / "ruler"


def cache_path(tokenizer: Any, context_length: int, n_examples: int, seed: int, tasks: Sequence[str],
               cache_dir: Path | None = None) -> Path:
    """File of the cached frame for these arguments (a JSON-lines file)."""
    key = json.dumps(
        {
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "context_length": context_length,
            "n_examples": n_examples,
            "seed": seed,
            "tasks": list(tasks),
            "version": GENERATOR_VERSION,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return folder / f"ruler-{context_length}-{n_examples}-seed{seed}-{digest}.jsonl"


def write_frame_jsonl(df: pd.DataFrame, path: Path) -> None:
    """Write ``df`` as JSON lines atomically (temporary file, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in df.to_dict("records"):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_frame_jsonl(path: Path) -> pd.DataFrame:
    """Read a frame written by ``write_frame_jsonl``."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return finalize_frame(pd.DataFrame.from_records(records, columns=FRAME_COLUMNS))


def generate_ruler(
    tokenizer: Any,
    context_length: int,
    n_examples: int = 130,
    seed: int = 0,
    tasks: list[str] | None = None,
    cache_dir: Path | None = None,
    *,
    use_cache: bool = True,
    load_fn: Callable | None = None,
) -> pd.DataFrame:
    """Generate RULER offline: ``n_examples`` spread evenly over ``tasks`` ("RULER-130" by default).

    Parameters
    ----------
    tokenizer
        Hugging Face tokenizer; each example's ``context`` has at most ``context_length`` of its tokens,
        as many as the haystack granularity allows (a noise line, a word, a needle line, a document).
    context_length : int
        Target context tokens.
    n_examples : int
        Total examples; task counts differ by at most one (seeded remainder).
    seed : int
        Same seed, same frame. Examples are seeded by (seed, task, index), so a task's examples do not
        depend on which other tasks are asked for.
    tasks : list of str, optional
        Default: the 11 offline tasks. ``qa_1``/``qa_2`` need the Hugging Face hub (RuntimeError if not
        reachable).
    cache_dir : Path, optional
        Where frames are cached (default ``default_cache_dir()``), keyed by tokenizer fingerprint,
        length, count, seed, tasks and generator version. ``use_cache=False`` neither reads nor writes.
    load_fn : callable, optional
        Replaces ``datasets.load_dataset`` for the QA tasks (tests).

    Returns
    -------
    DataFrame with ``FRAME_COLUMNS``, rows grouped by task in ``tasks`` order, ``example_id`` = ``"{task}-{i}"``.
    """
    tasks = _check_tasks(tasks)
    path = cache_path(tokenizer, context_length, n_examples, seed, tasks, cache_dir)
    if use_cache and path.exists():
        return read_frame_jsonl(path)

    rows = []
    for task, count in spread_examples(n_examples, tasks, seed).items():
        guess = None
        family = _task_family(task)
        for i, build in enumerate(_builders(task, context_length, count, seed, load_fn)):
            example, tokens, guess = _generate_one(
                build, f"ruler/{seed}/{task}/{i}", tokenizer, context_length, MIN_SIZE.get(task, 0), guess
            )
            rows.append(
                {
                    "example_id": f"{task}-{i}",
                    "task": task,
                    "context": example.context,
                    "question": example.question,
                    "answer_prefix": example.answer_prefix,
                    "answer": example.answer,
                    "max_new_tokens": MAX_NEW_TOKENS[family],
                    "context_tokens": tokens,
                }
            )
    df = finalize_frame(pd.DataFrame.from_records(rows, columns=FRAME_COLUMNS))
    if use_cache:
        write_frame_jsonl(df, path)
    return df
