"""A run next to a reference run (``make demo``: this machine's cpu-quick next to the committed one).

Both are results folders (or .jsonl files) of ``kvprob run``; they are compared on the average
score over tasks per (method, compression ratio) and on the overall win score, each recomputed
from the raw records with ``evaluation.report.aggregate``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.report.aggregate import REFERENCE, average_table, win_scores
from evaluation.report.tables import markdown_table
from evaluation.store.results import load_results, results_files


def _averages(df: pd.DataFrame) -> pd.DataFrame:
    avg = average_table(df)
    avg = avg[avg["dataset"] == "all"]
    return avg[["press", "compression_ratio", "score"]]


def average_comparison(run: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Columns method, ratio, this run, reference, difference: one row per (method, ratio) found in
    either; NaN where one side lacks it. The full cache comes first, then methods by name."""
    both = _averages(run).merge(_averages(reference), on=["press", "compression_ratio"], how="outer",
                                suffixes=("_run", "_ref"))
    both["difference"] = both["score_run"] - both["score_ref"]
    both["_order"] = (both["press"] != REFERENCE).astype(int)
    both = both.sort_values(["_order", "press", "compression_ratio"], ignore_index=True)
    return both.rename(columns={"press": "method", "compression_ratio": "ratio", "score_run": "this run",
                                "score_ref": "reference"}).drop(columns="_order")


def win_comparison(run: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Columns method, this run, reference: overall win scores side by side."""
    pick = lambda df: win_scores(df)[["press", "win_score"]]
    both = pick(run).merge(pick(reference), on="press", how="outer", suffixes=("_run", "_ref"))
    both = both.sort_values(["win_score_run", "press"], ascending=[False, True], ignore_index=True)
    return both.rename(columns={"press": "method", "win_score_run": "this run", "win_score_ref": "reference"})


def comparison_markdown(run_path: Path | str, reference_path: Path | str) -> str:
    """Markdown: the two tables, headed by where each side comes from."""
    run, reference = (load_results(*results_files(p)) for p in (run_path, reference_path))
    models = sorted(set(run["model"]) | set(reference["model"]))
    note = "" if len(models) == 1 else f"\n(different models: {', '.join(models)}; the numbers are not comparable)\n"
    avg = average_comparison(run, reference)
    wins = win_comparison(run, reference)
    same = avg["difference"].dropna()
    agreement = (f"{int((same.abs() < 1e-9).sum())} of {len(avg)} (method, ratio) averages are equal"
                 if len(same) else "no (method, ratio) in common")
    fmt = lambda frame, f: markdown_table(frame, index=False, float_format=f)
    return "\n".join([
        f"## This run ({run_path}) next to the reference ({reference_path})\n{note}",
        "### Average score over tasks\n",
        fmt(avg.assign(ratio=avg["ratio"].map("{:g}".format)), "{:.1f}"),
        f"\n{agreement}.\n",
        "### Win score (overall)\n",
        fmt(wins, "{:.3f}"),
    ])


def kl_table(df: pd.DataFrame) -> pd.DataFrame:
    """Columns press, compression_ratio, kl: a prose run's mean KL(full || press) per scored token, over
    windows (a sampling press's seeds averaged within a window first); the full cache is left out."""
    df = df[df["press"] != REFERENCE]
    per_window = df.groupby(["press", "compression_ratio", "example_id"], as_index=False)["kl"].mean()
    return per_window.groupby(["press", "compression_ratio"], as_index=False)["kl"].mean()


def prose_comparison_markdown(run_path: Path | str, reference_path: Path | str) -> str:
    """Markdown: a prose run's mean KL per (method, ratio) next to the reference run's (``kvprob prose run``
    records), with the number of windows of each."""
    run, reference = (load_results(*results_files(p)) for p in (run_path, reference_path))
    both = kl_table(run).merge(kl_table(reference), on=["press", "compression_ratio"], how="outer",
                               suffixes=("_run", "_ref"))
    both["difference"] = both["kl_run"] - both["kl_ref"]
    both = both.sort_values(["compression_ratio", "kl_run", "press"], ignore_index=True)
    both = both.rename(columns={"press": "method", "compression_ratio": "ratio", "kl_run": "this run",
                                "kl_ref": "reference"})
    windows = f"{run['example_id'].nunique()} windows here, {reference['example_id'].nunique()} in the reference"
    same = both["difference"].dropna()
    agreement = (f"{int((same.abs() < 1e-9).sum())} of {len(both)} (method, ratio) mean KLs are equal"
                 if len(same) else "no (method, ratio) in common")
    return "\n".join([
        f"## Prose: this run ({run_path}) next to the reference ({reference_path})\n",
        f"### Mean KL(full || press) per scored token, nats (lower is better; {windows})\n",
        markdown_table(both.assign(ratio=both["ratio"].map("{:g}".format)), index=False, float_format="{:.4f}"),
        f"\n{agreement}.",
    ])
