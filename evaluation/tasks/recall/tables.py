"""The recall records as tables: per press and ratio the token accuracy, NLL increase and KL over
windows, paired differences against a reference press, win scores over essays. The unit is the window
(a sampling press's seeds averaged within it first; ``evaluation.report.stats``); pairs are on the same windows.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.report import stats
from evaluation.report.aggregate import REFERENCE, win_scores
from evaluation.tasks.prose.tables import (_ci, complete_windows, kl_ratio_cells, mean_cells, prepare, press_groups,
                                     write_essay_tables)
from evaluation.report.tables import markdown_table
from evaluation.tasks.prose.tables import references as prose_references

VALUES = ("acc", "nll_delta", "kl")


def references(df: pd.DataFrame, reference: str | None = None) -> dict[float, str]:
    """The reference at each ratio: ``reference`` if given, else the deterministic press with the
    highest mean accuracy there (a maximum of noisy means on the same windows: it favours top-k): the
    lowest mean of minus the accuracy (``evaluation.tasks.prose.tables.references``)."""
    return prose_references(df.assign(neg_acc=-df["acc"]), reference, "neg_acc")


def summary(df: pd.DataFrame, refs: dict[float, str]) -> pd.DataFrame:
    """One row per (ratio, press): each value's mean and t-interval over windows, accuracy and KL minus
    the reference's paired over windows (with the windows where the press is better), the KL ratio to
    the reference (paired bootstrap), bytes held, seconds per configuration."""
    rows = []
    for ratio, ref, at, press, g, means in press_groups(df, refs, VALUES):
        row = {"compression_ratio": ratio, "press": press, "reference": ref, "windows": g["example_id"].nunique(),
               "essays": g["task"].nunique(), "seeds": g["seed"].nunique(), "held": g["held"].mean(),
               "seconds": g["seconds"].mean()}
        for v in VALUES:
            row |= mean_cells(means[v], v, press)
            if press != ref:
                d = stats.paired_table(at, v, "press", press, ref).iloc[0]
                better = d["a_better"]  # windows where a < b (lower is better)
                if v == "acc":  # higher is better: the windows where -a < -b
                    better = stats.paired_table(at.assign(neg=-at["acc"]), "neg", "press", press, ref).iloc[0]["a_better"]
                row |= {f"{v}_diff": d["mean"], f"{v}_diff_lo": d["lo"], f"{v}_diff_hi": d["hi"],
                        f"{v}_better": int(better), "pairs": int(d["n"])}
        rows.append(row | kl_ratio_cells(means["kl"], press, ref))
    return pd.DataFrame(rows).sort_values(["compression_ratio", "acc", "press"], ascending=[True, False, True],
                                          ignore_index=True)


def wins(df: pd.DataFrame) -> pd.DataFrame:
    """Win scores over essays (a unit is one essay at one ratio): by accuracy, and by minus the KL."""
    parts = []
    for v, sign in (("acc", 1), ("kl", -1)):
        frame = df.assign(score=sign * df[v], dataset="recall")
        w = win_scores(frame[["model", "dataset", "task", "example_id", "press", "compression_ratio", "seed", "score"]])
        parts.append(w.set_index("press")[["win_score", "rank"]].add_prefix(f"{v}_"))
    return pd.concat(parts, axis=1).reset_index().sort_values(["acc_rank", "press"], ignore_index=True)


def _ratio_table(s: pd.DataFrame) -> pd.DataFrame:
    ref = s["reference"].iloc[0]
    return pd.DataFrame({
        "press": s["press"],
        "accuracy": [_ci(r.acc, r.acc_lo, r.acc_hi, "{:.1f}") for r in s.itertuples()],
        f"acc − {ref} (higher)": ["–" if r.press == ref else _ci(r.acc_diff, r.acc_diff_lo, r.acc_diff_hi, "{:.1f}", True)
                                  + f" ({r.acc_better:.0f}/{r.pairs:.0f})" for r in s.itertuples()],
        "KL": [_ci(r.kl, r.kl_lo, r.kl_hi) for r in s.itertuples()],
        f"KL / {ref}": [_ci(r.kl_ratio, r.kl_ratio_lo, r.kl_ratio_hi, "{:.2f}") for r in s.itertuples()],
        "ΔNLL": [_ci(r.nll_delta, r.nll_delta_lo, r.nll_delta_hi, signed=True) for r in s.itertuples()],
        "held": [f"{h:.3f}" for h in s["held"]],
        "s/config": [f"{x:.2f}" for x in s["seconds"]],
    }).set_index("press")


def markdown(df: pd.DataFrame, info: dict, reference: str | None = None) -> str:
    df, dropped = complete_windows(prepare(df))
    refs = references(df, reference)
    s = summary(df, refs)
    full = df[df["press"] == REFERENCE]
    full_acc = stats.mean_ci(full.groupby("example_id")["acc_full"].first())
    cues = int(full["cues"].sum())
    lines = [f"# Recall benchmark: {info.get('split')} split, n = {info.get('context_length')}", "",
             f"Split: **{info.get('split')}**. {df['example_id'].nunique()} windows of {df['task'].nunique()} essays, "
             f"{cues} cued sentences" + (f" ({dropped} incomplete windows left out)" if dropped else "")
             + "; sampling presses over seeds averaged within a window first. Accuracy: % of the sentence's "
             "teacher-forced tokens whose argmax is the sentence's token (mean over a window's cues, then over "
             "windows, 95 % t-interval); KL(full ‖ press) and ΔNLL per token (nats). Full cache accuracy: "
             f"{_ci(full_acc['mean'], full_acc['lo'], full_acc['hi'], '{:.1f}')}. Held: bytes held over the full "
             "cache's.", ""]
    for command in dict.fromkeys(info.get("commands") or []):
        lines.append(f"Command: `{command}`")
    w = wins(df).set_index("press")
    lines += ["", f"## Win scores over essays ({df['task'].nunique()} essays × {len(refs)} ratios)", "",
              markdown_table(w, float_format="{:.3f}"), ""]
    for ratio, part in s.groupby("compression_ratio"):
        lines += [f"## r = {ratio:g}: against {refs[ratio]}, paired over windows", "",
                  markdown_table(_ratio_table(part)), ""]
    return "\n".join(lines)


def write(paths, out: Path | None = None, reference: str | None = None) -> tuple[Path, str]:
    """Write ``report.md`` and ``summary.csv`` for the results ``paths``. Returns (report path, text)."""
    return write_essay_tables(paths, out, reference, markdown, summary, references)


__all__ = ["references", "summary", "wins", "markdown", "write"]
