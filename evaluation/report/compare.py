"""Probabilistic presses against the best top-k press, paired on examples (docs/protocol.md, "Splits").

"The best top-k" at a ratio is the top-k press with the highest mean score at that ratio among
those in the results, chosen on the same examples it is compared on: a maximum of several noisy
means, so it favours top-k. Each sampling press is then compared with it by the paired
per-example difference (seeds averaged within an example first), with a 95 % t-interval and a
paired t-test (``evaluation.report.stats``). Win scores are those of ``evaluation.report.aggregate`` over the
presses shown.

``kvprob compare --results runs/ruler-1024 --split test --out runs/ruler-1024/compare.md``
"""

from __future__ import annotations

import pandas as pd

from evaluation.report.aggregate import REFERENCE, prepare, win_scores
from evaluation.report.stats import mean_table, paired_table
from evaluation.report.tables import markdown_table
from kvpress_prob.names.registry import PRESSES, is_sampling


def kinds(presses) -> tuple[list[str], list[str]]:
    """(top-k presses, sampling presses) among registry names; other labels are left out."""
    names = [p for p in dict.fromkeys(presses) if p in PRESSES]
    return [p for p in names if not is_sampling(p)], [p for p in names if is_sampling(p)]


def score_means(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score per press and ratio over examples (seeds averaged first), with its t-interval."""
    return mean_table(df, "score", by=["press", "compression_ratio"])


def best_topk(means: pd.DataFrame, topk: list[str]) -> dict[float, str]:
    """The top-k press with the highest mean at each ratio."""
    sub = means[means["press"].isin(topk)]
    return {ratio: g.sort_values(["mean", "press"], ascending=[False, True]).iloc[0]["press"]
            for ratio, g in sub.groupby("compression_ratio")}


def versus_best(df: pd.DataFrame, prob: list[str], best: dict[float, str]) -> pd.DataFrame:
    """Each sampling press minus the best top-k at each ratio, paired on examples."""
    parts = []
    for ratio, champion in best.items():
        at = df[df["compression_ratio"] == ratio]
        for press in prob:
            part = paired_table(at, "score", "press", press, champion)
            part.insert(0, "compression_ratio", ratio)
            parts.append(part)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _interval(mean, lo, hi, digits=1) -> str:
    if pd.isna(mean):
        return "–"
    if pd.isna(lo):
        return f"{mean:+.{digits}f}"
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def complete(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows of the presses run on every example of the frame, rows of the others): a sweep
    whose press list was cut part-way leaves the dropped presses on the first examples only."""
    counts = df.groupby("press")["example_id"].nunique()
    whole = counts[counts == counts.max()].index
    return df[df["press"].isin(whole)], df[~df["press"].isin(whole)]


def _score_cells(means: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    table = means.assign(cell=[f"{m:.1f} ± {h:.1f}" if pd.notna(h) else f"{m:.1f}"
                               for m, h in zip(means["mean"], means["half"])])
    wide = table.pivot(index="press", columns="compression_ratio", values="cell")
    wide = wide.loc[[p for p in order if p in wide.index]]
    wide.columns = [f"r = {c:g}" for c in wide.columns]
    return wide


def _difference_cells(diff: pd.DataFrame, order: list[str], best: dict[float, str]) -> pd.DataFrame:
    diff = diff.assign(cell=[_interval(m, lo, hi) + f" ({b}/{n})"
                             for m, lo, hi, b, n in zip(diff["mean"], diff["lo"], diff["hi"], diff["a_better"], diff["n"])])
    wide = diff.pivot(index="a", columns="compression_ratio", values="cell")
    wide = wide.loc[[p for p in order if p in wide.index]]
    wide.columns = [f"r = {c:g} vs {best[c]}" for c in wide.columns]
    return wide


def shared_examples(df: pd.DataFrame, presses: list[str]) -> pd.DataFrame:
    """The rows of ``presses`` (and the full cache) on the examples where every one of them has a
    result at every ratio it was run at: a paired comparison of exactly the same examples."""
    df = df[df["press"].isin([REFERENCE, *presses])]
    cells = df.groupby("example_id").apply(lambda g: set(zip(g["press"], g["compression_ratio"])), include_groups=False)
    wanted = set().union(*cells) if len(cells) else set()
    keep = cells[cells.map(lambda c: c >= wanted)].index
    return df[df["example_id"].isin(keep)]


def markdown(df: pd.DataFrame, split: str, title: str = "Probabilistic presses vs the best top-k",
             presses: list[str] | None = None) -> str:
    """The comparison as markdown: scores, the best top-k, paired differences, win scores; presses
    run on fewer examples than the others (stopped early) get their own rows, on their examples.
    With ``presses``, only those, on the examples all of them completed."""
    df = prepare(df)
    if presses:
        df = shared_examples(df, presses)
    topk, prob = kinds(df["press"].unique())
    df, early = complete(df[df["press"].isin([REFERENCE, *topk, *prob])])
    early_topk, early_prob = kinds(early["press"].unique())
    topk, prob = [p for p in topk if p not in early_topk], [p for p in prob if p not in early_prob]
    n_examples = df["example_id"].nunique()
    tasks = sorted(df["task"].unique())
    means = score_means(df[df["press"] != REFERENCE])
    full = df[df["press"] == REFERENCE]["score"]
    lines = [f"# {title} ({split} split)", "",
             f"{n_examples} examples ({len(tasks)} tasks: {', '.join(tasks)}); "
             f"sampling presses over seeds {sorted(df[df['press'].isin(prob)]['seed'].unique().tolist())}. "
             f"Full cache: {full.mean():.1f}.", ""]
    wide = _score_cells(means, [*topk, *prob])
    wide.index.name = "press (mean ± 95 % half-width)"
    lines += ["## Scores", "", markdown_table(wide), ""]
    best = best_topk(means, topk)
    if best and prob:
        wide = _difference_cells(versus_best(df, prob, best), prob, best)
        wide.index.name = "press − best top-k [95 % t-interval] (examples where lower)"
        lines += ["## Against the best top-k at each ratio (paired on examples)", "", markdown_table(wide), ""]
    if not early.empty:
        counts = early.groupby("press")["example_id"].nunique()
        order = [*early_topk, *early_prob]
        wide = _score_cells(score_means(early), order)
        wide.insert(0, "examples", [int(counts[p]) for p in wide.index])
        wide.index.name = "stopped early: press (its examples only)"
        lines += ["## Presses stopped part-way (scores on the examples they ran)", "", markdown_table(wide), ""]
        if best:
            both = pd.concat([df[df["press"].isin(best.values())], early])
            wide = _difference_cells(versus_best(both, order, best), order, best)
            wide.index.name = "stopped early: press − best top-k (shared examples)"
            lines += [markdown_table(wide), ""]
    wins = win_scores(df)
    wins.index = wins.pop("press")
    wins.index.name = "press"
    lines += ["## Win scores (over the presses above)", "", markdown_table(wins, float_format="{:.3f}"), ""]
    return "\n".join(lines)
