"""Aggregation of the results DataFrame: score tables, averages, win scores, task ranks.

Pure functions on the frame written by ``evaluation.store.results`` (one row per example and
configuration). Conventions shared by every function here:

- A method's score on a (model, dataset, task, press, compression_ratio) is the mean over
  examples within each seed, then the mean over seeds; the spread (``score_std``) is the
  sample standard deviation over seeds (ddof=1), 0.0 when there is a single seed.
- The uncompressed reference has ``press == "full"`` (``REFERENCE``), one row per example at
  compression_ratio 0. It appears in score tables (``broadcast_reference`` repeats it at every
  ratio for display) but never in win scores or task ranks.
- Ratios are rounded to 6 decimals before grouping.
- If one (model, dataset, task) was run on several ``data_dir`` values (e.g. RULER at 4096 and
  8192 tokens in one store), the task is relabelled ``"<task> [<data_dir>]"`` so that the
  lengths stay separate units (``prepare``).
"""

from __future__ import annotations

import logging
from typing import Iterable

import numpy as np
import pandas as pd

logger = logging.getLogger(__name__)

REFERENCE = "full"
TASK_KEYS = ["model", "dataset", "task"]
UNIT_KEYS = ["model", "dataset", "task", "compression_ratio"]
CONFIG_KEYS = ["model", "dataset", "task", "press", "compression_ratio"]
TIE_TOLERANCE = 1e-9  # two scores closer than this (on the 0..100 scale) are a tie


# --------------------------------------------------------------------------- preparation


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    """A clean copy of the results frame: typed columns, defaults, RULER lengths kept apart.

    Fills a missing ``data_dir`` with "" and a missing ``seed`` with 0, rounds ratios, and
    relabels tasks that span several data_dirs (see the module docstring).
    """
    required = {"model", "dataset", "task", "example_id", "press", "compression_ratio", "score"}
    missing = required - set(df.columns)
    if missing:
        raise ValueError(f"results frame lacks columns {sorted(missing)}")
    out = df.copy()
    if "data_dir" not in out:
        out["data_dir"] = ""
    if "seed" not in out:
        out["seed"] = 0
    out["data_dir"] = out["data_dir"].fillna("").astype(str)
    out["seed"] = out["seed"].fillna(0).astype(int)
    out["example_id"] = out["example_id"].astype(str)
    out["compression_ratio"] = out["compression_ratio"].astype(float).round(6)
    out["score"] = out["score"].astype(float)
    spans = out.groupby(TASK_KEYS)["data_dir"].transform("nunique")
    if (spans > 1).any():
        many = spans > 1
        logger.warning("tasks run on several data_dirs are kept apart as '<task> [<data_dir>]'")
        out.loc[many, "task"] = out.loc[many, "task"] + " [" + out.loc[many, "data_dir"] + "]"
    return out


def _exclude(df: pd.DataFrame, exclude: Iterable) -> pd.DataFrame:
    """Drop tasks: a str drops that task everywhere, a (model, dataset, task) tuple drops one."""
    exclude = list(exclude)
    names = {e for e in exclude if isinstance(e, str)}
    triples = {tuple(e) for e in exclude if not isinstance(e, str)}
    drop = df["task"].isin(names)
    if triples:
        keys = pd.Series(list(zip(df["model"], df["dataset"], df["task"])), index=df.index)
        drop |= keys.isin(triples)
    return df[~drop]


def _seed_means(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score over examples per configuration and seed (``CONFIG_KEYS`` + seed)."""
    return df.groupby(CONFIG_KEYS + ["seed"], as_index=False).agg(
        score=("score", "mean"), n_examples=("example_id", "nunique")
    )


def _std(values: pd.Series) -> float:
    """Sample std over seeds, 0.0 for a single seed."""
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


# --------------------------------------------------------------------------- score tables


def score_table(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score per (model, dataset, task, press, compression_ratio).

    Columns: the keys, ``score`` (mean over seeds of the per-seed mean over examples),
    ``score_std`` (spread over seeds), ``n_seeds``, ``n_examples`` (distinct examples).
    """
    df = prepare(df)
    per_seed = _seed_means(df)
    table = per_seed.groupby(CONFIG_KEYS, as_index=False).agg(
        score=("score", "mean"), score_std=("score", _std), n_seeds=("seed", "nunique")
    )
    examples = df.groupby(CONFIG_KEYS, as_index=False).agg(n_examples=("example_id", "nunique"))
    table = table.merge(examples, on=CONFIG_KEYS)
    return table.sort_values(CONFIG_KEYS, ignore_index=True)


def broadcast_reference(table: pd.DataFrame, group_keys: Iterable[str] = ("model", "dataset", "task")) -> pd.DataFrame:
    """Repeat the reference rows (press "full") at every ratio used by the other methods.

    ``table`` is a score or average table with a ``compression_ratio`` column; the reference
    rows are replaced by copies at each ratio found among the other rows of the same group.
    A group without compressed rows keeps its reference row unchanged.
    """
    group_keys = [k for k in group_keys if k in table.columns]
    is_ref = table["press"] == REFERENCE
    ref, others = table[is_ref], table[~is_ref]
    if ref.empty:
        return table.copy()
    ratios = others[group_keys + ["compression_ratio"]].drop_duplicates()
    spread = ref.drop(columns="compression_ratio").merge(ratios, on=group_keys, how="inner")
    lone = ref.merge(ratios[group_keys].drop_duplicates(), on=group_keys, how="left", indicator=True)
    lone = lone[lone["_merge"] == "left_only"].drop(columns="_merge")
    out = pd.concat([others, spread[table.columns], lone[table.columns]], ignore_index=True)
    return out.sort_values(group_keys + ["compression_ratio", "press"], ignore_index=True)


def average_table(df: pd.DataFrame, exclude_tasks: Iterable = ()) -> pd.DataFrame:
    """Average over tasks per (model, dataset, press, compression_ratio), plus an overall row.

    ``exclude_tasks`` takes task names and/or (model, dataset, task) tuples (the output of
    ``uninformative_tasks``). The overall rows have ``dataset == "all"`` and weigh every
    (dataset, task) equally.

    Columns: model, dataset, press, compression_ratio, ``score`` (mean over tasks of the
    per-task scores of ``score_table``), ``score_std`` (std over seeds of the per-seed
    task averages), ``n_seeds``, ``n_tasks``.
    """
    df = _exclude(prepare(df), exclude_tasks)
    columns = ["model", "dataset", "press", "compression_ratio", "score", "score_std", "n_seeds", "n_tasks"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    per_task = score_table(df)
    per_seed = _seed_means(df)
    both = []
    for label, keys in (("dataset", ["model", "dataset"]), ("all", ["model"])):
        group = keys + ["press", "compression_ratio"]
        mean = per_task.groupby(group, as_index=False).agg(
            score=("score", "mean"), n_tasks=("task", "count")
        )
        seed_avg = per_seed.groupby(group + ["seed"], as_index=False)["score"].mean()
        spread = seed_avg.groupby(group, as_index=False).agg(
            score_std=("score", _std), n_seeds=("seed", "nunique")
        )
        table = mean.merge(spread, on=group)
        if label == "all":
            table.insert(1, "dataset", "all")
        both.append(table)
    out = pd.concat(both, ignore_index=True)[columns]
    return out.sort_values(["model", "dataset", "compression_ratio", "press"], ignore_index=True)


def uninformative_tasks(df: pd.DataFrame, threshold: float = 10.0) -> set[tuple[str, str, str]]:
    """Tasks on which the full-cache reference scores under ``threshold``.

    Returns the set of (model, dataset, task). A (model, dataset) without reference rows
    flags nothing.
    """
    df = prepare(df)
    ref = df[df["press"] == REFERENCE]
    if ref.empty:
        return set()
    per_seed = ref.groupby(TASK_KEYS + ["seed"])["score"].mean()
    per_task = per_seed.groupby(level=TASK_KEYS).mean()
    return {tuple(key) for key, value in per_task.items() if value < threshold}


# --------------------------------------------------------------------------- win score


def _unit_points(scores: pd.Series) -> pd.Series:
    """Points each method earns in one unit: 1 per lower opponent, 0.5 per tie.

    ``scores`` is indexed by press. Example: scores (a=50, b=50, c=10) give a=1.5, b=1.5, c=0.
    """
    values = scores.to_numpy(dtype=float)
    diff = values[:, None] - values[None, :]
    higher = (diff > TIE_TOLERANCE).sum(axis=1)
    ties = (np.abs(diff) <= TIE_TOLERANCE).sum(axis=1) - 1  # minus the method itself
    return pd.Series(higher + 0.5 * ties, index=scores.index)


def _win_one(table: pd.DataFrame) -> pd.DataFrame:
    """Win scores from a per-unit method score table (``score_table`` rows, no reference)."""
    earned: dict[str, float] = {}
    possible: dict[str, int] = {}
    units: dict[str, int] = {}
    for _, unit in table.groupby(UNIT_KEYS):
        if len(unit) < 2:
            continue  # a lone method has no opponent: the unit does not count for it
        points = _unit_points(unit.set_index("press")["score"])
        for press, value in points.items():
            earned[press] = earned.get(press, 0.0) + float(value)
            possible[press] = possible.get(press, 0) + len(unit) - 1
            units[press] = units.get(press, 0) + 1
    presses = sorted(set(table["press"]))
    out = pd.DataFrame({
        "press": presses,
        "win_score": [earned[p] / possible[p] if possible.get(p) else np.nan for p in presses],
        "units": [units.get(p, 0) for p in presses],
    })
    out["rank"] = out["win_score"].rank(ascending=False, method="min").astype("Int64")
    out = out.sort_values(["rank", "press"], ignore_index=True, na_position="last")
    return out[["press", "win_score", "rank", "units"]]


def win_scores(df: pd.DataFrame, by: str | None = None, exclude: Iterable = ()) -> pd.DataFrame:
    """The pairwise win score (docs/protocol.md, "Win score"), overall or per dataset / per model.

    A unit is (model, dataset, task, compression_ratio); a method's score in a unit is its
    mean over examples and seeds. In each unit, every method earns 1 per opponent it beats
    and 0.5 per tie (scores within ``TIE_TOLERANCE``). Win score = earned / possible, where
    possible = sum over the units the method is in of (methods present - 1); when every
    method is in every unit this is units x (methods - 1). Units with a single method are
    skipped. The reference ("full") never takes part. ``exclude`` takes task names and/or
    (model, dataset, task) tuples, e.g. ``uninformative_tasks(df)``.

    Returns columns [by,] press, win_score (in [0, 1]), rank (1 = best, ties share the best
    rank), units (units in which the method met at least one opponent).
    """
    if by not in (None, "dataset", "model"):
        raise ValueError(f"by must be None, 'dataset' or 'model', got {by!r}")
    df = prepare(df)
    df = _exclude(df[df["press"] != REFERENCE], exclude)
    columns = ([by] if by else []) + ["press", "win_score", "rank", "units"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    table = score_table(df)
    if by is None:
        return _win_one(table)
    parts = []
    for value, group in table.groupby(by):
        part = _win_one(group)
        part.insert(0, by, value)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)[columns]


# --------------------------------------------------------------------------- task ranks


def task_ranks(df: pd.DataFrame) -> pd.DataFrame:
    """Rank of each method on each (model, dataset, task), by its mean score over ratios.

    The mean is over the ratios at which the method was run (of the per-ratio scores of
    ``score_table``). The reference is left out. Rank 1 is best; ties share the best rank.
    Columns: model, dataset, task, press, score, rank, n_methods.
    """
    df = prepare(df)
    df = df[df["press"] != REFERENCE]
    columns = TASK_KEYS + ["press", "score", "rank", "n_methods"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    table = score_table(df)
    per_task = table.groupby(TASK_KEYS + ["press"], as_index=False)["score"].mean()
    grouped = per_task.groupby(TASK_KEYS)["score"]
    per_task["rank"] = grouped.rank(ascending=False, method="min").astype(int)
    per_task["n_methods"] = grouped.transform("count").astype(int)
    return per_task.sort_values(TASK_KEYS + ["rank", "press"], ignore_index=True)[columns]


def rank_extremes(ranks: pd.DataFrame, by: Iterable[str] = ("model",)) -> pd.DataFrame:
    """Each method's best and worst task rank (the paper's "collapse on single tasks").

    ``ranks`` is the output of ``task_ranks``; ``by`` groups (default per model, across
    datasets). Tasks sharing the best (worst) rank are joined with ", ".
    Columns: [by...], press, best_rank, best_tasks, worst_rank, worst_of (number of methods
    on that worst task, so worst_rank == worst_of means last), worst_tasks, n_tasks.
    """
    by = list(by)
    rows = []
    for key, group in ranks.groupby(by + ["press"]):
        key = key if isinstance(key, tuple) else (key,)
        best, worst = group["rank"].min(), group["rank"].max()
        worst_rows = group[group["rank"] == worst]
        rows.append(dict(
            zip(by + ["press"], key),
            best_rank=int(best),
            best_tasks=", ".join(sorted(group.loc[group["rank"] == best, "task"])),
            worst_rank=int(worst),
            worst_of=int(worst_rows["n_methods"].max()),
            worst_tasks=", ".join(sorted(worst_rows["task"])),
            n_tasks=len(group),
        ))
    columns = by + ["press", "best_rank", "best_tasks", "worst_rank", "worst_of", "worst_tasks", "n_tasks"]
    return pd.DataFrame(rows, columns=columns)


def config_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, dataset, press, ratio): mean score, realised ratio, KV bytes held relative to the
    full cache of the same example, and seconds per example (compression + decoding)."""
    df = prepare(df)
    full = df[df["press"] == REFERENCE].groupby(["model", "dataset", "data_dir", "example_id"])["kv_bytes"].first()
    df = df.join(full.rename("full_bytes"), on=["model", "dataset", "data_dir", "example_id"])
    df["kv_fraction"] = df["kv_bytes"] / df["full_bytes"]
    return (df.groupby(["model", "dataset", "press", "compression_ratio"], as_index=False)
              .agg(score=("score", "mean"), realised_ratio=("realised_ratio", "mean"),
                   kv_fraction=("kv_fraction", "mean"), seconds=("seconds", "mean"), results=("score", "size")))
