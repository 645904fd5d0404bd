"""Tables and plots of the decomposition (``experiments.decompose.run``).

Scores: each example's score at a step is its mean over the sampling seeds (one value for a
deterministic step); a step's change is the paired per-example difference from the step before,
summarised by its mean and a 95 % Student-t interval over examples (scipy.stats).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from evaluation.report.stats import mean_ci  # noqa: E402
from evaluation.report.tables import markdown_table  # noqa: E402
from evaluation.store.results import load_results, write_atomic  # noqa: E402
from experiments.decompose.steps import STEPS, all_configs  # noqa: E402


def interval(values) -> tuple[float, float, float, int]:
    """(mean, low, high, n): the 95 % Student-t interval of the mean (``evaluation.report.stats.mean_ci``);
    the bounds are the mean itself when n < 2 or the values do not vary."""
    ci = mean_ci(values)
    if ci["n"] < 2 or ci["half"] == 0:
        return ci["mean"], ci["mean"], ci["mean"], ci["n"]
    return ci["mean"], ci["lo"], ci["hi"], ci["n"]


def cell(mean, low, high, n=None) -> str:
    if np.isnan(mean):
        return "–"
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]" if low != high else f"{mean:+.1f}"


def md(table: pd.DataFrame, float_format: str = "{:.2f}") -> str:
    """A markdown table of a frame whose index may have several levels (joined by " / ")."""
    flat = table.copy()
    if isinstance(flat.index, pd.MultiIndex):
        flat.index = [" / ".join(map(str, key)) for key in flat.index]
        flat.index.name = " / ".join(map(str, table.index.names))
    flat.columns = [str(c) for c in flat.columns]
    return markdown_table(flat, float_format=float_format)


def step_frame(out: Path, families, ratios, seeds, extra=()) -> pd.DataFrame:
    """One row per (family, step, ratio, example): the score averaged over seeds."""
    paths = sorted(out.glob("results.jsonl")) + sorted(out.glob("shard-*.jsonl"))
    if not paths:
        return pd.DataFrame()
    results = load_results(*paths)
    labels = {(cfg.label, round(cfg.compression_ratio, 6)): (family, step)
              for family, step, cfg in all_configs(families, ratios, seeds, extra)}
    results["key"] = list(zip(results["press"], results["compression_ratio"].round(6)))
    rows = results[results["key"].isin(labels)].copy()
    rows[["family", "step"]] = pd.DataFrame(rows["key"].map(labels).tolist(), index=rows.index)
    return (rows.groupby(["family", "step", "compression_ratio", "task", "example_id"], as_index=False)
            .agg(score=("score", "mean"), seeds=("seed", "nunique")))


def paired_changes(frame: pd.DataFrame) -> pd.DataFrame:
    """Each step minus the step before it (and corrected minus topk), paired by example."""
    rows = []
    for (family, ratio), group in frame.groupby(["family", "compression_ratio"]):
        wide = group.pivot(index="example_id", columns="step", values="score")
        present = [s for s in STEPS if s in wide]
        pairs = list(zip(present[:-1], present[1:])) + [(present[0], present[-1])]
        for before, after in pairs:
            diff = (wide[after] - wide[before]).dropna()
            mean, low, high, n = interval(diff)
            rows.append({"family": family, "ratio": ratio, "change": f"{before} → {after}", "mean": mean,
                         "low": low, "high": high, "n_examples": n,
                         "better": int((diff > 0).sum()), "worse": int((diff < 0).sum())})
    return pd.DataFrame(rows)


def survival_frame(out: Path) -> pd.DataFrame:
    paths = sorted(out.glob("survival*.jsonl"))
    records = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]
    frame = pd.DataFrame(records)
    if frame.empty:
        return frame
    return frame.drop_duplicates(["example_id", "press", "compression_ratio", "seed"], keep="last")


def markdown(out: Path, families, ratios, seeds, extra=()) -> str:
    settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").exists() else {}
    split = "development" if settings.get("data_seed", 0) == 0 else "test"
    lines = [f"# Decomposition: top-k → probabilistic, one change at a time ({split} split)", "",
             f"Settings: `{json.dumps({k: settings.get(k) for k in ('context_length', 'data_seed', 'n_examples', 'tasks', 'seeds')})}`",
             "", "Steps: topk = kvpress's press; head = same scores as a proposal, top-k per head; "
             "layer / global = top-k under the paper's allocation; sampled = Poisson draws, no correction; "
             "corrected = with SNIS (the paper's press).", ""]
    frame = step_frame(out, families, ratios, seeds, extra)
    designs = frame[frame["family"] == "design"] if not frame.empty else frame
    frame = frame[frame["family"] != "design"] if not frame.empty else frame
    if not frame.empty:
        n_ex = frame["example_id"].nunique()
        lines += [f"## Scores (mean over {n_ex} examples; sampled steps averaged over seeds {seeds} first)", ""]
        table = frame.pivot_table(index=["family", "compression_ratio"], columns="step", values="score", aggfunc="mean")
        table = table[[s for s in STEPS if s in table]]
        lines += [md(table, "{:.1f}"), ""]
        changes = paired_changes(frame)
        changes["interval"] = [cell(m, lo, hi) for m, lo, hi in zip(changes["mean"], changes["low"], changes["high"])]
        wide = changes.pivot_table(index=["family", "change"], columns="ratio", values="interval", aggfunc="first")
        order = {c: i for i, c in enumerate(dict.fromkeys(changes["change"]))}
        wide = wide.sort_index(key=lambda idx: idx.map(order) if idx.name == "change" else idx)
        lines += ["## Paired change of each step (points, 95 % t-interval over examples)", "",
                  md(wide), ""]
        per_task = frame.pivot_table(index=["family", "compression_ratio", "task"], columns="step", values="score")
        per_task = per_task[[s for s in STEPS if s in per_task]]
        lines += ["## Per task", "", md(per_task, "{:.1f}"), ""]
        write_atomic(out / "changes.csv", changes.to_csv(index=False))
    if not designs.empty:
        table = designs.pivot_table(index="step", columns="compression_ratio", values="score", aggfunc="mean")
        table.index.name = "other design"
        lines += ["## Other designs on the same examples (mean score)", "", md(table, "{:.1f}"), ""]
    surv = survival_frame(out)
    if not surv.empty:
        surv = surv.dropna(subset=["survival"])
        other = surv[surv["family"] == "design"]
        surv = surv[surv["family"] != "design"]
        if not other.empty:
            table = other.pivot_table(index="step", columns="compression_ratio", values="survival", aggfunc="mean")
            table.index.name = "other design"
            lines += ["## Needle survival of other designs (%)", "", md(100 * table, "{:.1f}"), ""]
        table = surv.pivot_table(index=["family", "compression_ratio"], columns="step", values="survival", aggfunc="mean")
        table = table[[s for s in STEPS if s in table]]
        lines += [f"## Needle survival: fraction of (layer, KV head) pairs holding every token of a needle "
                  f"({surv['example_id'].nunique()} NIAH examples, sampled steps over seeds)", "",
                  md(100 * table, "{:.1f}"), ""]
    return "\n".join(lines)


def plot_survival(out: Path) -> Path | None:
    surv = survival_frame(out)
    if surv.empty:
        return None
    surv = surv.dropna(subset=["per_layer"])
    surv = surv[surv["family"] != "design"]
    ratios = sorted(surv["compression_ratio"].unique())
    families = list(dict.fromkeys(surv["family"]))
    fig, axes = plt.subplots(len(families), len(ratios), figsize=(3.2 * len(ratios), 2.4 * len(families)),
                             squeeze=False, sharey=True)
    for i, family in enumerate(families):
        for j, ratio in enumerate(ratios):
            ax = axes[i][j]
            sub = surv[(surv["family"] == family) & (surv["compression_ratio"] == ratio)]
            for step in STEPS:
                layers = sub[sub["step"] == step]["per_layer"].tolist()
                if layers:
                    ax.plot(np.mean(np.array(layers), axis=0), label=step)
            ax.set_title(f"{family}, r = {ratio}", fontsize=8)
            ax.set_ylim(-0.02, 1.02)
            if j == 0:
                ax.set_ylabel("needle survival")
            if i == len(families) - 1:
                ax.set_xlabel("layer")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    path = out / "survival_per_layer.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path, families, ratios, seeds, extra=()) -> Path:
    text = markdown(out, families, ratios, seeds, extra)
    plot = plot_survival(out)
    if plot is not None:
        text += f"\n![needle survival per layer]({plot.name})\n"
    write_atomic(out / "report.md", text)
    print(f"report: {out / 'report.md'}")
    return out / "report.md"
