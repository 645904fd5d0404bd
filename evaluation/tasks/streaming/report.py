"""Tables of a streaming results folder, paired over streams (``evaluation.report.stats``: the seeds of a press
averaged within each stream first, then a 95 % t-interval over streams).

Per setting (budget, chunk, interval):

- every press: NLL increase and KL(full || compressed) in nats per scored token, each with its
  interval, the ratio of its mean to the best baseline's (the baseline, of ``presses.BASELINES``, with the
  lowest mean NLL increase, resp. KL), the entries per KV head it held after its last round and
  attended during a forward (most), and its bytes (keys, values and the correction bias it keeps) over
  the keys and values of ``budget`` entries;
- every other press minus the best baseline, paired on streams, with the streams it wins;
- every corrected press minus its ``_nocorr`` twin, every ``<x>_layers`` or ``<x>_heads`` (per-layer or
  per-head budgets) minus ``<x>``, and every sampled ``prob_decode_<x>_priority`` minus the top-k
  ``decode_<x>_topk`` over the same proposal.

The header names the split, the streams and the commands that wrote the folder (from its manifests).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.report.stats import mean_table, paired_table
from evaluation.report.tables import markdown_table
from evaluation.store.manifest import read
from evaluation.store.results import load_folders, results_files, write_atomic
from evaluation.tasks.streaming.presses import BASELINES

SETTING = ["budget", "chunk", "interval"]
VALUES = {"nll_increase": "NLL increase", "kl": "KL"}
SPLIT_NAMES = {"dev": "development", "test": "test"}


def _interval(row) -> str:
    if pd.isna(row["lo"]):
        return f"{row['mean']:.4f}"
    return f"{row['mean']:.4f} [{row['lo']:.4f}, {row['hi']:.4f}]"


def _difference(row) -> str:
    if pd.isna(row["lo"]):
        return f"{row['mean']:+.4f} (n={row['n']})"
    return f"{row['mean']:+.4f} [{row['lo']:+.4f}, {row['hi']:+.4f}]"


def best_baseline(df: pd.DataFrame, value: str) -> str | None:
    """The baseline with the lowest mean ``value`` over streams in ``df`` (one setting), None if none ran."""
    means = mean_table(df[df["press"].isin(BASELINES)], value, ["press"])
    return None if means.empty else str(means.sort_values("mean").iloc[0]["press"])


def press_table(df: pd.DataFrame) -> pd.DataFrame:
    """One setting's per-press table (module docstring), best NLL increase first."""
    columns = {}
    for value, label in VALUES.items():
        means = mean_table(df, value, ["press"]).set_index("press")
        best = best_baseline(df, value)
        columns[label] = means.apply(_interval, axis=1)
        columns[f"{label} / best baseline"] = (means["mean"] / means.loc[best, "mean"]).map("{:.2f}".format) if best else "–"
        columns.setdefault("streams", means["n"].astype(int))
    # keys and values of `budget` entries per KV head in every layer: measured by `drive.feed` (records since
    # per-layer budgets, whose layers hold different counts); older records: from the largest layer
    budget_bytes = df["kv_bytes"] / df["held_end"] * df["budget"]
    if "budget_bytes" in df:
        budget_bytes = df["budget_bytes"].where(df["budget_bytes"].notna(), budget_bytes)
    memory = (df["kv_bytes"] + df["bias_bytes"]) / budget_bytes
    sizes = df.assign(memory=memory).groupby("press").agg(
        held=("held_end", "max"), attended=("attended_max", "max"), bytes=("memory", "max"), seeds=("seed", "nunique"))
    sizes["bytes"] = sizes["bytes"].map("{:.3f}".format)
    table = pd.DataFrame(columns).join(sizes)
    order = mean_table(df, "nll_increase", ["press"]).sort_values("mean")["press"]
    table = table.loc[list(order)]
    table.index.name = "press"
    return table


def paired_rows(df: pd.DataFrame, pairs: list[tuple[str, str]]) -> pd.DataFrame:
    """a - b of each metric for each pair, paired on streams, with a's wins (a < b) of n."""
    rows = []
    for a, b in pairs:
        row = {"a − b": f"{a} − {b}"}
        for value, label in VALUES.items():
            t = paired_table(df, value, "press", a, b)
            if t.empty:
                break
            t = t.iloc[0]
            row[label] = _difference(t)
            row[f"{label} ratio"] = f"{t['mean_a'] / t['mean_b']:.2f}" if t["mean_b"] else "–"
            row[f"{label} wins"] = f"{int(t['a_better'])}/{int(t['n'])}"
        else:
            rows.append(row)
    return pd.DataFrame(rows).set_index("a − b") if rows else pd.DataFrame()


def twins(presses: list[str]) -> list[tuple[str, str]]:
    """(corrected, uncorrected) for every ``<name>_nocorr`` whose ``<name>`` ran too."""
    return [(p.removesuffix("_nocorr"), p) for p in presses if p.endswith("_nocorr") and p.removesuffix("_nocorr") in presses]


def budget_twins(presses: list[str]) -> list[tuple[str, str]]:
    """(per-layer or per-head budgets, one budget per head): ``<name>_layers`` / ``<name>_heads`` and ``<name>``."""
    return [(p, p.rsplit("_", 1)[0]) for p in presses
            if p.endswith(("_layers", "_heads")) and p.rsplit("_", 1)[0] in presses]


def topk_twins(presses: list[str]) -> list[tuple[str, str]]:
    """(sampled, top-k) over one proposal: ``prob_decode_<x>_priority[_nocorr]`` and ``decode_<x>_topk``."""
    pairs = []
    for p in presses:
        stem = p.removesuffix("_nocorr")
        if stem.startswith("prob_decode_") and stem.endswith("_priority"):
            topk = "decode_" + stem.removeprefix("prob_decode_").removesuffix("_priority") + "_topk"
            if topk in presses:
                pairs.append((p, topk))
    return pairs


def commands(folder: Path) -> list[str]:
    """The commands recorded in the folder's manifests, in run order, without repeats."""
    out = []
    for path in results_files(folder):
        for run in (read(path) or {}).get("runs", []):
            if run.get("command") and run["command"] not in out:
                out.append(run["command"])
    return out


def markdown(folder: Path | str) -> str:
    folder = Path(folder)
    df = load_folders([folder])
    if df.empty:
        raise ValueError(f"no streaming results in {folder}")
    splits = sorted(df["split"].unique())
    lines = [f"# Streaming benchmark: {', '.join(SPLIT_NAMES.get(s, s) + ' split' for s in splits)}", ""]
    lines += [f"- Model: {', '.join(sorted(df['model'].unique()))}.",
              f"- Streams: {df['example_id'].nunique()} of {', '.join(map(str, sorted(df['n_tokens'].unique())))} "
              f"tokens ({', '.join(sorted(df['example_id'].unique()))}).",
              "- Values: nats per scored token (every prediction after the first compression), mean over streams "
              "of the seed-averaged value, 95 % t-interval over streams; differences paired on streams.",
              "- Memory: entries per KV head held after a round and attended during a forward (held, attended); "
              "bytes: keys, values and the correction bias a press keeps beside them, over the keys and values "
              "of budget entries (a corrected press holds fewer entries to pay for its bias).", ""]
    cmds = commands(folder)
    if cmds:
        lines += ["Commands:", "", "```", *cmds, "```", ""]
    for setting, part in df.groupby(SETTING):
        budget, chunk, interval = setting
        lines += [f"## Budget {budget}, chunk {chunk}, interval {interval} ({SPLIT_NAMES.get(splits[0], splits[0])} split, "
                  f"{part['example_id'].nunique()} streams)", ""]
        lines += [markdown_table(press_table(part)), ""]
        presses = sorted(part["press"].unique())
        others = [p for p in presses if p not in BASELINES]
        bests = dict.fromkeys(best_baseline(part, value) for value in VALUES)  # the same baseline once
        for value, label in VALUES.items():
            best = best_baseline(part, value)
            if best in bests and others:
                del bests[best]
                table = paired_rows(part, [(p, best) for p in others])
                lines += [f"Minus the best baseline by {label} ({best}):", "", markdown_table(table), ""]
        pairs = twins(presses)
        if pairs:
            lines += ["Corrected minus uncorrected:", "", markdown_table(paired_rows(part, pairs)), ""]
        pairs = budget_twins(presses)
        if pairs:
            lines += ["Per-layer or per-head budgets minus one budget per head:", "",
                      markdown_table(paired_rows(part, pairs)), ""]
        pairs = topk_twins(presses)
        if pairs:
            lines += ["Sampled (priority) minus top-k over the same proposal:", "",
                      markdown_table(paired_rows(part, pairs)), ""]
    return "\n".join(lines)


def write(folder: Path | str) -> Path:
    """``<folder>/report.md``; returns its path."""
    folder = Path(folder)
    return write_atomic(folder / "report.md", markdown(folder))
