"""Markdown/CSV tables of a results frame, and the report that holds them with its plots (``plots``).

``write_report(df, out_dir, title)`` writes, under ``out_dir``:

- ``report.md``: every table below, with the plots embedded;
- ``summary.md``: the short version (average score and win score) also returned as
  ``summary_markdown`` for a CLI to print;
- CSVs (long format): ``scores_per_task.csv``, ``average.csv``, ``average_informative.csv``,
  ``win_scores.csv``, ``task_ranks.csv``, ``rank_extremes.csv``, ``uninformative_tasks.csv``;
- PNGs in ``plots/``: score vs compression ratio per task (one figure per model and dataset,
  one panel per task), the average (one figure per model, one panel per dataset and "all"),
  and the win-score bar chart.

Every file is written atomically (``store.write_atomic``). Plots use the Agg canvas directly
(no pyplot state). Markdown tables are formatted here (``markdown_table``), ``tabulate`` is
not needed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from evaluation.report.aggregate import (
    REFERENCE,
    average_table,
    config_table,
    broadcast_reference,
    prepare,
    rank_extremes,
    score_table,
    task_ranks,
    uninformative_tasks,
    win_scores,
)
from evaluation.report.plots import colours, plot_panels, plot_win_scores, press_order
from evaluation.store.results import write_atomic

MARK = "†"  # marks tasks on which the full cache scores under the threshold


# --------------------------------------------------------------------------- formatting


def _cell(value, float_format: str = "{:.2f}") -> str:
    """One markdown cell: floats formatted, NaN/None as '–', pipes escaped."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return float_format.format(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


_NUMERIC = re.compile(r"^[\d.,+\-–±/ e]*$")


def markdown_table(frame: pd.DataFrame, index: bool = True, float_format: str = "{:.2f}") -> str:
    """A GitHub-flavoured markdown table.

    The first column is left-aligned; the others are right-aligned when every cell looks
    like a number ('42.0 ± 1.3', '2/5', '–'), left-aligned otherwise.
    """
    header = ([str(frame.index.name or "")] if index else []) + [str(c) for c in frame.columns]
    rows = []
    for label, row in frame.iterrows():
        cells = [_cell(v, float_format) for v in row.tolist()]
        rows.append(([_cell(label)] if index else []) + cells)
    align = [":---"] + [
        "---:" if all(_NUMERIC.match(r[j]) for r in rows) else ":---" for j in range(1, len(header))
    ]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def ratio_label(ratio: float) -> str:
    """Column label of a compression ratio: 'r=0.5'."""
    return f"r={ratio:g}"


def _score_cell(score: float, std: float, n_seeds: int) -> str:
    """'42.0' or '42.0 ± 1.3' when several seeds were run."""
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return "–"
    return f"{score:.1f} ± {std:.1f}" if n_seeds > 1 else f"{score:.1f}"


def ratio_pivot(table: pd.DataFrame) -> pd.DataFrame:
    """Rows press, columns ratio, cells 'score ± std' (a table of one group, reference broadcast)."""
    cells = table.assign(
        cell=[_score_cell(s, d, n) for s, d, n in zip(table["score"], table["score_std"], table["n_seeds"])]
    )
    pivot = cells.pivot(index="press", columns="compression_ratio", values="cell")
    pivot = pivot.reindex(press_order(pivot.index))
    pivot.columns = [ratio_label(r) for r in pivot.columns]
    pivot.index.name = "method"
    return pivot.fillna("–")


def _slug(text: str) -> str:
    """A file-name-safe version of a model or task name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text).replace("/", "--"))


def _task_label(model: str, dataset: str, task: str, flagged: set) -> str:
    """Task name with the uninformative marker when flagged."""
    return f"{task} {MARK}" if (model, dataset, task) in flagged else task


# --------------------------------------------------------------------------- tables


def win_table_long(df: pd.DataFrame, flagged: set) -> pd.DataFrame:
    """Win scores overall / per dataset / per model, with all tasks and without the flagged.

    Columns: scope (overall | dataset | model), group, tasks (all | informative), press,
    win_score, rank, units. The 'informative' variant is present only if tasks are flagged.
    """
    variants = [("all", ())] + ([("informative", flagged)] if flagged else [])
    parts = []
    for tasks, exclude in variants:
        for by in (None, "dataset", "model"):
            table = win_scores(df, by=by, exclude=exclude)
            if table.empty:
                continue
            group = table.pop(by) if by else "all"
            table.insert(0, "scope", by or "overall")
            table.insert(1, "group", group)
            table.insert(2, "tasks", tasks)
            parts.append(table)
    columns = ["scope", "group", "tasks", "press", "win_score", "rank", "units"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def win_markdown(wins: pd.DataFrame, scope: str, group: str) -> str:
    """One win-score table: rows method, columns win score and rank (all / informative tasks)."""
    part = wins[(wins["scope"] == scope) & (wins["group"] == group)]
    out = None
    for tasks, suffix in (("all", ""), ("informative", f" (no {MARK})")):
        sub = part[part["tasks"] == tasks]
        if sub.empty:
            continue
        sub = sub.set_index("press")
        cols = pd.DataFrame({
            f"win score{suffix}": sub["win_score"].map(lambda v: _cell(float(v), "{:.3f}")),
            f"rank{suffix}": sub["rank"].map(lambda v: "–" if pd.isna(v) else str(int(v))),
        })
        if tasks == "all":
            cols["units"] = sub["units"].astype(int).astype(str)
        out = cols if out is None else out.join(cols, how="outer")
    if out is None:
        return "_no comparable methods_\n"
    first_rank = out.columns[1]
    out = out.assign(_r=pd.to_numeric(out[first_rank], errors="coerce")).sort_values("_r").drop(columns="_r")
    out.index.name = "method"
    return markdown_table(out)


def _average_sections(avg: pd.DataFrame) -> list[str]:
    """Markdown tables of an average table, one per (model, dataset incl. 'all')."""
    if avg.empty:
        return ["_no data_\n"]
    out = []
    shown = broadcast_reference(avg, group_keys=("model", "dataset"))
    groups = dict(list(shown.groupby(["model", "dataset"])))
    for model, dataset in dict.fromkeys(zip(avg["model"], avg["dataset"])):
        table = groups[(model, dataset)]
        n_tasks = int(table["n_tasks"].max())
        out.append(f"**{model} · {dataset}** (tasks: {n_tasks})\n\n{markdown_table(ratio_pivot(table))}")
    return out


def _order_avg(avg: pd.DataFrame) -> pd.DataFrame:
    """Put each model's 'all' rows after its datasets."""
    key = avg["dataset"].eq("all").astype(int)
    return avg.assign(_k=key).sort_values(["model", "_k", "dataset", "compression_ratio", "press"]).drop(columns="_k")


def summary_markdown(title: str, avg: pd.DataFrame, wins: pd.DataFrame) -> str:
    """The short report: average score per ratio (over all tasks, per model) and overall win scores."""
    lines = [f"## {title}\n"]
    if not avg.empty:
        multi = avg[avg["dataset"] != "all"]["dataset"].nunique() > 1
        pick = avg[avg["dataset"] == "all"] if multi else avg[avg["dataset"] != "all"]
        lines.append("### Average score per compression ratio\n")
        lines += _average_sections(pick)
    lines.append("### Win score (overall)\n")
    lines.append(win_markdown(wins, "overall", "all"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the report


def write_report(df: pd.DataFrame, out_dir: Path, title: str, threshold: float = 10.0) -> dict:
    """Write the full report of a results frame under ``out_dir``.

    Returns a dict mapping names ('report_md', 'summary_md', 'scores_csv', 'average_csv',
    'average_informative_csv', 'win_scores_csv', 'task_ranks_csv', 'rank_extremes_csv',
    'uninformative_csv', 'plot_win', 'plot_average:<model>', 'plot_scores:<model>:<dataset>')
    to written paths, plus 'summary_markdown': the summary text for a CLI to print.
    """
    out_dir = Path(out_dir)
    plots = out_dir / "plots"
    df = prepare(df)
    if df.empty:
        raise ValueError("no results to report")
    flagged = uninformative_tasks(df, threshold)
    scores = score_table(df)
    avg = _order_avg(average_table(df))
    avg_inf = _order_avg(average_table(df, exclude_tasks=flagged))
    wins = win_table_long(df, flagged)
    ranks = task_ranks(df)
    extremes = rank_extremes(ranks)
    palette = colours(df["press"].unique())
    paths: dict = {}

    def csv(name: str, frame: pd.DataFrame, filename: str) -> None:
        paths[name] = write_atomic(out_dir / filename, frame.to_csv(index=False))

    csv("scores_csv", scores, "scores_per_task.csv")
    csv("average_csv", avg, "average.csv")
    csv("average_informative_csv", avg_inf, "average_informative.csv")
    csv("win_scores_csv", wins, "win_scores.csv")
    csv("task_ranks_csv", ranks, "task_ranks.csv")
    csv("rank_extremes_csv", extremes, "rank_extremes.csv")
    configs = config_table(df)
    csv("configurations_csv", configs, "configurations.csv")
    csv("uninformative_csv", pd.DataFrame(sorted(flagged), columns=["model", "dataset", "task"]),
        "uninformative_tasks.csv")

    # plots
    shown_scores = broadcast_reference(scores)
    for (model, dataset), table in shown_scores.groupby(["model", "dataset"]):
        panels = [(_task_label(model, dataset, task, flagged), t) for task, t in table.groupby("task")]
        name = f"plot_scores:{model}:{dataset}"
        paths[name] = plot_panels(panels, f"{model} · {dataset}", palette,
                                   plots / f"scores__{_slug(model)}__{_slug(dataset)}.png")
    shown_avg = broadcast_reference(avg, group_keys=("model", "dataset"))
    for model, table in shown_avg.groupby("model"):
        by_dataset = dict(list(table.groupby("dataset")))
        order = sorted(by_dataset, key=lambda d: (d == "all", d))
        panels = [(f"{dataset} (average)", by_dataset[dataset]) for dataset in order]
        paths[f"plot_average:{model}"] = plot_panels(panels, f"{model} · average score", palette,
                                                      plots / f"average__{_slug(model)}.png")
    if not wins.empty:
        paths["plot_win"] = plot_win_scores(wins, plots / "win_scores.png")

    # markdown
    def rel(path: Path) -> str:
        return path.relative_to(out_dir).as_posix()

    md = [f"# {title}\n", _overview(df), ""]
    md.append("## Average score per compression ratio\n")
    md += _average_sections(avg)
    md += [f"![average {m}]({rel(p)})\n" for k, p in paths.items() if k.startswith("plot_average:")
           for m in [k.split(":", 1)[1]]]
    md.append(f"## Average score without uninformative tasks ({MARK})\n")
    if flagged:
        listed = ", ".join(f"{t} ({m} · {d})" for m, d, t in sorted(flagged))
        md.append(f"{MARK} marks tasks on which the full cache scores under {threshold:g}, so that no "
                  f"method can be told apart there: {listed}. These tables leave them out.\n")
        md += _average_sections(avg_inf)
    else:
        md.append(f"No task is uninformative: the full cache scores at least {threshold:g} on every task "
                  "(or no full-cache reference was run).\n")
    md.append("## Win score\n")
    md.append("A unit is (model, dataset, task, compression ratio). In each unit a method earns 1 per "
              "method it beats and 0.5 per tie, on its mean score over examples and seeds; win score = "
              "earned / (units x (methods - 1)), counting only the methods present in each unit. The "
              "full cache takes no part."
              + (f" Columns marked (no {MARK}) leave out the uninformative tasks." if flagged else "") + "\n")
    md.append("### Overall\n")
    md.append(win_markdown(wins, "overall", "all"))
    for scope, heading in (("dataset", "Per dataset"), ("model", "Per model")):
        for group in sorted(wins.loc[wins["scope"] == scope, "group"].unique()):
            md.append(f"### {heading}: {group}\n")
            md.append(win_markdown(wins, scope, group))
    if "plot_win" in paths:
        md.append(f"![win scores]({rel(paths['plot_win'])})\n")
    md.append("## Per-task ranks\n")
    md.append("Rank of each method on each task by its mean score over compression ratios "
              "(1 = best, out of the number of methods on the task).\n")
    md += _rank_sections(ranks, extremes, flagged)
    md.append("## Configurations\n")
    md.append("Mean over examples and seeds: score, realised compression ratio, keys and values held as a "
              "fraction of the full cache (stored, padding included), seconds per example (compression + "
              "decoding; the shared prefill is not counted).\n")
    md.append(markdown_table(configs, index=False, float_format="{:.3f}"))
    md.append("## Score per task\n")
    md.append("Mean over examples within a seed, then mean ± std over seeds (± only with several seeds). "
              "`full` is the uncompressed reference, repeated at every ratio.\n")
    for (model, dataset, task), table in shown_scores.groupby(["model", "dataset", "task"]):
        n = int(table["n_examples"].max())
        md.append(f"### {model} · {dataset} · {_task_label(model, dataset, task, flagged)} ({n} examples)\n")
        md.append(markdown_table(ratio_pivot(table)))
    md += [f"![scores {k.split(':', 1)[1]}]({rel(p)})\n" for k, p in paths.items() if k.startswith("plot_scores:")]

    summary = summary_markdown(title, avg, wins)
    paths["report_md"] = write_atomic(out_dir / "report.md", "\n".join(md))
    paths["summary_md"] = write_atomic(out_dir / "summary.md", summary)
    paths["summary_markdown"] = summary
    return paths


def _overview(df: pd.DataFrame) -> str:
    """One paragraph saying what the report covers."""
    ratios = sorted(df.loc[df["press"] != REFERENCE, "compression_ratio"].unique())
    return (f"{len(df)} results · models: {', '.join(sorted(df['model'].unique()))} · datasets: "
            f"{', '.join(sorted(df['dataset'].unique()))} · methods: "
            f"{', '.join(press_order(df['press'].unique()))} · ratios: "
            f"{', '.join(f'{r:g}' for r in ratios)} · seeds: {df['seed'].nunique()}\n")


def _rank_sections(ranks: pd.DataFrame, extremes: pd.DataFrame, flagged: set) -> list[str]:
    """Per model: a method x task rank table and the best/worst task of each method."""
    if ranks.empty:
        return ["_no methods to rank_\n"]
    out = []
    for model, table in ranks.groupby("model"):
        several = table["dataset"].nunique() > 1
        labels = [(f"{d}/" if several else "") + _task_label(model, d, t, flagged)
                  for d, t in zip(table["dataset"], table["task"])]
        cells = table.assign(col=labels, cell=[f"{r}/{n}" for r, n in zip(table["rank"], table["n_methods"])])
        pivot = cells.pivot(index="press", columns="col", values="cell")
        pivot = pivot[list(dict.fromkeys(labels))].fillna("–")
        pivot.index.name = "method"
        pivot.columns.name = None
        out.append(f"### {model}\n")
        out.append(markdown_table(pivot))
        ext = extremes[extremes["model"] == model].set_index("press")
        ext = pd.DataFrame({
            "best rank": ext["best_rank"].astype(str),
            "best on": ext["best_tasks"],
            "worst rank": [f"{r}/{n}" for r, n in zip(ext["worst_rank"], ext["worst_of"])],
            "worst on": ext["worst_tasks"],
        }, index=ext.index)
        ext.index.name = "method"
        out.append(markdown_table(ext))
    return out
