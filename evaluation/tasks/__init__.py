"""Benchmark frames for the harness: RULER (generated offline, or kvpress' set from the hub) and LongBench.

Every loader returns a ``pandas.DataFrame`` with one row per example and the columns of
``FRAME_COLUMNS`` (kvpress' dataset columns plus two of ours):

==================  ===========  ==============================================================
column              type         meaning
==================  ===========  ==============================================================
example_id          str          stable id, unique within the frame (``"niah_single_1-3"``, LongBench ``_id``)
task                str          task name (``"niah_single_1"``, ``"vt"``, ``"hotpotqa"``, ...)
context             str          the long part, compressed by the press
question            str          asked after the context
answer_prefix       str          start of the assistant's answer
answer              list[str]    reference answers
max_new_tokens      int          generation budget of the task
context_tokens      int          tokens of ``context`` with the loader's tokenizer (no special tokens)
==================  ===========  ==============================================================

Submodules are imported lazily so that ``import evaluation.tasks`` stays cheap.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pandas as pd

from evaluation.tasks.frame import FRAME_COLUMNS, count_tokens  # noqa: F401  (the frame's public names)

DATASET_NAMES = ("ruler", "ruler-hub", "longbench")


def dataset_version(name: str) -> int | None:
    """The version a run's manifest records for dataset ``name``: the offline RULER generator's; None for the
    hub's sets (their revision is the hub's)."""
    if name == "ruler":
        from evaluation.tasks.ruler.offline import GENERATOR_VERSION

        return GENERATOR_VERSION
    return None


def load_dataset_frame(
    name: str,
    tokenizer: Any,
    *,
    context_length: int = 4096,
    n_examples: int = 130,
    seed: int = 0,
    tasks: Sequence[str] | None = None,
    cache_dir: Any = None,
    fraction: float = 0.02,
    random_state: int = 42,
    max_context_tokens: int = 3000,
    load_fn: Callable | None = None,
) -> pd.DataFrame:
    """Load a benchmark frame by name.

    Parameters
    ----------
    name : {"ruler", "ruler-hub", "longbench"}
        ``ruler``: offline RULER generator (``context_length``, ``n_examples``, ``seed``, ``tasks``,
        ``cache_dir``). ``ruler-hub``: kvpress' prebuilt set ``simonjegou/ruler`` sampled like kvpress
        (``context_length``, ``fraction``, ``random_state``, ``load_fn``; ``tasks`` filters after
        sampling). ``longbench``: HotpotQA, QASPER and TriviaQA concatenated, or the ``tasks`` subset
        (``max_context_tokens``, ``load_fn``).
    tokenizer
        Counts context tokens (and fills RULER haystacks).

    Raises
    ------
    ValueError
        For an unknown name; the message lists the valid ones.
    """
    if name == "ruler":
        from evaluation.tasks.ruler.offline import generate_ruler

        return generate_ruler(
            tokenizer, context_length, n_examples=n_examples, seed=seed, tasks=tasks, cache_dir=cache_dir,
            load_fn=load_fn,
        )
    if name == "ruler-hub":
        from evaluation.tasks.ruler.hub import load_ruler_hub

        df = load_ruler_hub(context_length, fraction, random_state, load_fn=load_fn, tokenizer=tokenizer)
        return df if tasks is None else df[df["task"].isin(list(tasks))].reset_index(drop=True)
    if name == "longbench":
        from evaluation.tasks.longbench import LONGBENCH_TASKS, load_longbench

        frames = [
            load_longbench(task, tokenizer, max_context_tokens=max_context_tokens, load_fn=load_fn)
            for task in (tasks or LONGBENCH_TASKS)
        ]
        return pd.concat(frames, ignore_index=True)
    raise ValueError(f"Unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
