"""Report of the attention-error bench (``experiments.attention.run``): does a measure predict answers?

A cell is one (press, ratio): each measure, the KL and the decoded score (from the runner's
results of the same examples and seeds) are averaged over examples and seeds. For each measure:

- pooled: Spearman's rho across all cells (lower error should mean a higher score: rho with the
  score is expected negative, with the KL positive), a 95 % bootstrap interval that resamples
  presses (all ratios of a press together), and a two-sided permutation p-value;
- within ratio: the mean over ratios of Spearman's rho across the presses at that ratio, with a
  permutation p-value that permutes the measure among the presses of each ratio. The ratio alone
  orders every measure and every score, so this is the test of a measure's use for screening
  designs at a given budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from evaluation.report.tables import markdown_table
from evaluation.store.results import load_results, write_atomic

MEASURES = ("mean_layer_err", "needle_err", "needle_top_err", "needle_last_err", "needle_recall", "needle_top_recall",
            "needle_whole", "kl", "kl_answer")
TARGETS = ("score", "kl")
N_PERMUTATIONS = 2000
N_BOOT = 2000


def cells(records: pd.DataFrame, scores: pd.DataFrame | None) -> pd.DataFrame:
    """One row per (press, ratio): every measure averaged over seeds within an example, then over
    examples. With ``scores`` (the runner's records), only the examples that have a decoded score
    for that press and ratio are kept, and the score (mean over its seeds) is averaged the same way."""
    keys = ["press", "compression_ratio", "example_id"]
    present = [m for m in MEASURES if m in records]
    per_example = records.groupby(keys)[present].mean().reindex(columns=list(MEASURES))
    if scores is not None and len(scores):
        score = scores.groupby(keys)["score"].mean()
        per_example = per_example.join(score, how="inner")
    table = per_example.groupby(["press", "compression_ratio"]).mean()
    table["examples"] = per_example.groupby(["press", "compression_ratio"]).size()
    return table.reset_index()


def _rho(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho (average ranks for ties); NaN with fewer than 3 finite pairs or a constant side."""
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(rankdata(x[ok]), rankdata(y[ok]))[0, 1])


def _within(x: np.ndarray, y: np.ndarray, groups: list[np.ndarray]) -> float:
    """Mean over the ratio groups (index arrays) of rho within each group."""
    rhos = [r for r in (_rho(x[g], y[g]) for g in groups) if np.isfinite(r)]
    return float(np.mean(rhos)) if rhos else float("nan")


def _p_value(null: np.ndarray, observed: float) -> float:
    """Two-sided permutation p-value, counting the observed statistic itself (never 0)."""
    if not np.isfinite(observed):
        return float("nan")
    null = null[np.isfinite(null)]
    return float((1 + (np.abs(null) >= abs(observed) - 1e-12).sum()) / (1 + len(null)))


def correlations(table: pd.DataFrame, n_permutations: int = N_PERMUTATIONS, n_boot: int = N_BOOT,
                 seed: int = 0) -> pd.DataFrame:
    """Spearman's rho of every measure with every target, pooled and within ratio (module docstring)."""
    rng = np.random.default_rng(seed)
    rows = []
    for target in TARGETS:
        if target not in table or table[target].isna().all():
            continue
        for measure in MEASURES:
            if measure == target or measure not in table or table[measure].isna().all():
                continue
            sub = table.dropna(subset=[measure, target]).reset_index(drop=True)
            x, y = sub[measure].to_numpy(float), sub[target].to_numpy(float)
            groups = [g.to_numpy() for _, g in sub.groupby("compression_ratio").groups.items()]
            by_press = [g.to_numpy() for _, g in sub.groupby("press").groups.items()]
            pooled, within = _rho(x, y), _within(x, y, groups)
            null_pooled = np.array([_rho(rng.permutation(x), y) for _ in range(n_permutations)])
            null_within = []
            for _ in range(n_permutations):
                shuffled = x.copy()
                for g in groups:
                    shuffled[g] = rng.permutation(x[g])
                null_within.append(_within(shuffled, y, groups))
            boot = []
            for _ in range(n_boot):
                pick = np.concatenate([by_press[i] for i in rng.integers(0, len(by_press), len(by_press))])
                boot.append(_rho(x[pick], y[pick]))
            boot = np.array([b for b in boot if np.isfinite(b)])
            rows.append({"measure": measure, "target": target, "cells": len(sub), "presses": len(by_press),
                         "rho_pooled": pooled,
                         "ci_low": float(np.quantile(boot, 0.025)) if len(boot) else float("nan"),
                         "ci_high": float(np.quantile(boot, 0.975)) if len(boot) else float("nan"),
                         "p_pooled": _p_value(null_pooled, pooled), "rho_within_ratio": within,
                         "p_within_ratio": _p_value(np.array(null_within), within)})
    return pd.DataFrame(rows)


def shapes_table(path: Path) -> pd.DataFrame | None:
    if not path.exists():
        return None
    frame = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines()])
    frame["needle_share_over_uniform"] = frame["needle_share"] / frame["uniform_share"]
    return frame.groupby("press")[["effective_support", "needle_share", "uniform_share",
                                   "needle_share_over_uniform"]].mean().reset_index()


def _jsonl(path: Path) -> pd.DataFrame:
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])


def load_measures(out: Path) -> pd.DataFrame:
    """records.jsonl (teacher-forced measures) outer-joined with retention.jsonl (cache measures) on
    (example, press, ratio, seed)."""
    keys = ["example_id", "press", "compression_ratio", "seed"]
    records, kept = _jsonl(out / "records.jsonl"), _jsonl(out / "retention.jsonl")
    if len(kept):
        kept = kept[keys + [c for c in kept if c.startswith("needle_") and c not in records]]
        records = kept if not len(records) else records.merge(kept, on=keys, how="outer")
    return records if len(records) else pd.DataFrame(columns=keys + list(MEASURES))


def write(out: Path, score_paths) -> dict:
    records = load_measures(out)
    scores = load_results(*score_paths) if score_paths else None
    table = cells(records, scores)
    corr = correlations(table) if scores is not None else pd.DataFrame()
    shapes = shapes_table(out / "proposals.jsonl")
    lines = ["# Attention-error bench", "",
             f"{records['example_id'].nunique()} examples, {records['press'].nunique()} presses, ratios "
             f"{sorted(records['compression_ratio'].unique())}; errors at the question's rows, KL teacher-forced "
             "on the question and gold answer; scores decoded by the runner on the same examples and seeds "
             f"({', '.join(map(str, score_paths)) or 'none given'}).", ""]
    if len(corr):
        lines += ["## Spearman correlation across (press, ratio) cells", "",
                  "rho with the score should be negative for a useful error measure (positive for the needle_recall "
                  "and needle_whole retention measures, where higher is better), with the KL the other way round. "
                  "Pooled: 95 % bootstrap interval over presses, permutation p-value. Within ratio: the mean "
                  "over ratios of rho across presses, permutation p-value within each ratio.", "",
                  markdown_table(corr, index=False, float_format="{:.3f}"), ""]
    lines += ["## Cells (mean over examples and seeds)", "", markdown_table(table, index=False, float_format="{:.4f}"), ""]
    if shapes is not None:
        lines += ["## Proposal shape (sampling presses)", "",
                  "effective support = exp(H(pi)) / n (1 = uniform); needle share = the proposal's mass on the "
                  "needle tokens, mean over layers and KV heads; uniform share = |needle| / n.", "",
                  markdown_table(shapes, index=False, float_format="{:.4f}"), ""]
    write_atomic(out / "report.md", "\n".join(lines))
    summary = {"correlations": corr.to_dict("records"), "cells": table.to_dict("records"),
               "proposal_shape": None if shapes is None else shapes.to_dict("records")}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2, default=float))
    print("\n".join(lines))
    return summary
