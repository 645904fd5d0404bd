"""The fidelity records as tables: KL per configuration, paired comparisons per scorer family,
budget scopes, layer-wise error with its bias^2 / variance split. Intervals and paired tests come
from ``evaluation.report.stats`` (examples are the units, seeds averaged within an example)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.bench.fidelity import FAMILIES, PAIRS
from evaluation.bench.fidelity.measure import record_setting, setting
from evaluation.report import stats
from evaluation.store.results import ResultStore

PER_SEED = ("kl", "kl_answer", "top1", "nll_answer", "realised_ratio")


def load_records(out_dir: Path) -> pd.DataFrame:
    """One row per (example, configuration): the records of ``records.jsonl`` with the runner's
    label in ``press`` (older records are relabelled), m backfilled from ``m.jsonl`` where a record
    lacks it, seed means ``<figure>_mean``, ``temperature`` (float) and ``main`` (not a sweep row)."""
    path = Path(out_dir) / "records.jsonl"
    records = ResultStore(path, readonly=True).records() if path.exists() else []
    if not records:
        return pd.DataFrame()
    df = pd.DataFrame.from_records(records)
    df["press"] = [record_setting(r).label for r in records]
    df["budget"] = df["budget"].fillna("global") if "budget" in df else "global"
    if "m" not in df:
        df["m"] = np.nan
    backfill = Path(out_dir) / "m.jsonl"  # m of records written before m was recorded
    if backfill.exists():
        known = {(r["data_dir"], r["example_id"], legacy_setting(r["press"], r["compression_ratio"]).label,
                  round(float(r["compression_ratio"]), 6)): r["m"] for r in ResultStore(backfill, readonly=True).records()}
        keys = zip(df["data_dir"], df["example_id"], df["press"], df["compression_ratio"].astype(float).round(6))
        df["m"] = [m if m is not None and np.isfinite(m) else known.get(k, np.nan)
                   for m, k in zip(df["m"].astype(float), keys)]
    df["m"] = df["m"].astype(float)
    for col in PER_SEED:
        df[f"{col}_mean"] = df[col].map(lambda v: float(np.mean(v)))
    df["nll_delta_mean"] = df["nll_answer_mean"] - df["ref_nll_answer"]
    df["temperature"] = df["temperature"].map(float)
    df["main"] = df["phase"].fillna("main").eq("main") if "phase" in df else True
    return df


def legacy_setting(label: str, ratio: float):
    """The configuration named by a label of the form ``press@tau=2@budget=head`` (records and
    ``m.jsonl`` lines written before the runner's labels were used; their ``tau`` is the temperature)."""
    name, *parts = label.split("@")
    fields = dict(part.split("=", 1) for part in parts)
    temperature = fields.get("tau")
    return setting(name, ratio, None if temperature is None else float(temperature), fields.get("budget"))


def per_seed(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (example, configuration, seed): the frame ``evaluation.report.stats`` works on."""
    keep = ["example_id", "press", "method", "compression_ratio", "budget", "temperature", "main", "seeds", *PER_SEED]
    long = df[keep].explode(["seeds", *PER_SEED]).rename(columns={"seeds": "seed"})
    return long.astype({col: float for col in PER_SEED}).reset_index(drop=True)


def order(labels, preferred) -> list:
    labels = list(dict.fromkeys(labels))
    first = [p for p in preferred if p in labels]
    return first + sorted(x for x in labels if x not in first)


def kl_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (configuration label, ratio): KL and answer KL over examples (seed-averaged) with their
    t-intervals, a bootstrap interval of KL, top-1 agreement, ΔNLL, realised ratio, seed spread."""
    long = per_seed(df)
    by = ["press", "compression_ratio"]
    kl = stats.mean_table(long, "kl", by).set_index(by)
    answer = stats.mean_table(long, "kl_answer", by).set_index(by)
    rows = []
    for (label, ratio), g in df.groupby(by, sort=False):
        ci, ca = kl.loc[(label, ratio)], answer.loc[(label, ratio)]
        blo, bhi = stats.bootstrap_ci(g["kl_mean"])
        seed_sd = g["kl"].map(lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"))
        rows.append({
            "press": label, "method": g["method"].iloc[0], "temperature": g["temperature"].iloc[0], "ratio": ratio,
            "main": bool(g["main"].any()), "kl": ci["mean"], "kl_lo": ci["lo"], "kl_hi": ci["hi"],
            "kl_boot_lo": blo, "kl_boot_hi": bhi,
            "kl_answer": ca["mean"], "kl_answer_lo": ca["lo"], "kl_answer_hi": ca["hi"],
            "top1": float(g["top1_mean"].mean()), "nll_delta": float(g["nll_delta_mean"].mean()),
            "realised_ratio": float(g["realised_ratio_mean"].mean()),
            "seed_sd": float(np.nanmean(seed_sd)) if seed_sd.notna().any() else float("nan"),
            "n_examples": int(ci["n"]), "n_seeds": int(g["seeds"].map(len).max()),
            "seconds_per_run": float(np.mean([s for v in g["seconds"] for s in v])),
        })
    return pd.DataFrame(rows)


def _main_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["temperature"] == 1.0) & df["main"]]


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per family, ratio and pair of roles: KL(A) - KL(B) over the shared examples (seed means),
    with its t-interval and paired t-test."""
    long = per_seed(_main_rows(df))
    frames = []
    for family, roles in FAMILIES.items():
        for a, b in PAIRS:
            if a in roles and b in roles:
                t = stats.paired_table(long, "kl", "press", roles[a], roles[b], by=["compression_ratio"])
                frames.append(t.assign(family=family, comparison=f"{a} − {b}"))
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True).rename(columns={
        "compression_ratio": "ratio", "a": "A", "b": "B", "mean": "diff", "a_better": "A_better",
        "mean_a": "kl_A", "mean_b": "kl_B"})
    rank = {family: i for i, family in enumerate(FAMILIES)}
    out = out.assign(_rank=out["family"].map(rank)).sort_values(["_rank", "ratio"], kind="stable")
    return out.drop(columns="_rank").reset_index(drop=True)


def scope_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per sampling method run under several budget scopes, per ratio and scope: KL, the paired
    difference to the global scope and to the family's kvpress top-k press (equal ratio per layer)."""
    main = _main_rows(df)
    if main.empty or main["budget"].eq("global").all():
        return pd.DataFrame()
    long = per_seed(main)
    top_k = {name: roles["top-k"] for roles in FAMILIES.values() for role, name in roles.items() if role != "top-k"}
    rows = []
    for method in main.loc[main["budget"] != "global", "method"].unique():
        for ratio in sorted(main["compression_ratio"].unique()):
            part = long[long["compression_ratio"] == ratio]
            runs = main[(main["method"] == method) & (main["compression_ratio"] == ratio)]
            for (label, budget), g in runs.groupby(["press", "budget"], sort=False):
                kl = stats.mean_table(part[part["press"] == label], "kl", []).iloc[0]
                row = {"method": method, "ratio": ratio, "scope": budget,
                       **{f"kl_{k}": kl[k] for k in ("mean", "lo", "hi", "half", "n", "sd")}}
                for name, other in (("global", method), ("top-k", top_k.get(method))):
                    if other is None or (name == "global" and budget == "global"):
                        continue
                    d = stats.paired_table(part, "kl", "press", label, other)
                    if d.empty:
                        continue
                    d = d.iloc[0]
                    row.update({f"vs_{name}": d["mean"], f"vs_{name}_lo": d["lo"], f"vs_{name}_hi": d["hi"],
                                f"vs_{name}_p": d["p_value"], f"vs_{name}_better": f"{d['a_better']}/{d['n']}"})
                row["top_k_press"] = top_k.get(method)
                row["realised_ratio"] = float(g["realised_ratio_mean"].mean())
                rows.append(row)
    return pd.DataFrame(rows)


def debiased_bias2(bias2: float, variance: float, n_seeds: int) -> float:
    """The plug-in bias^2 over S seeds, ||mean_s o_s - o||^2, overestimates the true bias^2 by
    Var / S in expectation; with variance = (1/S) sum_s ||o_s - mean||^2 (E = (S-1)/S Var), the
    unbiased estimate is bias2 - variance / (S - 1). NaN with one seed."""
    return bias2 - variance / (n_seeds - 1) if n_seeds > 1 else float("nan")


def layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (label, ratio): per-layer relative error (mean over seeds, then examples), bias^2, variance."""
    rows = []
    have = df[df["layer_err"].map(lambda v: isinstance(v, list) and len(v) > 0)] if "layer_err" in df else df.iloc[:0]
    for (label, ratio), g in have.groupby(["press", "compression_ratio"], sort=False):
        err = np.mean([np.mean(np.asarray(v), axis=0) for v in g["layer_err"]], axis=0)
        mse = np.mean([np.mean(np.asarray(v) ** 2, axis=0) for v in g["layer_err"]], axis=0)
        bias2 = np.mean([np.asarray(v) for v in g["bias2"]], axis=0)
        var = np.mean([np.asarray(v) for v in g["variance"]], axis=0)
        rows.append({"press": label, "method": g["method"].iloc[0], "temperature": g["temperature"].iloc[0], "ratio": ratio,
                     "main": bool(g["main"].any()), "err_layers": err.tolist(), "bias2_layers": bias2.tolist(),
                     "var_layers": var.tolist(), "err_mean": float(err.mean()), "err_first": float(err[0]),
                     "err_last": float(err[-1]), "mse_mean": float(mse.mean()), "bias2_mean": float(bias2.mean()),
                     "var_mean": float(var.mean()),
                     "bias2_debiased": debiased_bias2(float(bias2.mean()), float(var.mean()),
                                                      int(g["seeds"].map(len).min())),
                     "n_seeds": int(g["seeds"].map(len).max()), "n_examples": len(g),
                     "m_mean": float(g["m"].mean()) if g["m"].notna().all() else float("nan")})
    return pd.DataFrame(rows)


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y on log x over the points with x, y > 0 (NaN with fewer than 3)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0]) if ok.sum() >= 3 else float("nan")
