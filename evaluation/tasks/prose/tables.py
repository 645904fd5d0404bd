"""The prose records as tables: per press and ratio the mean KL and NLL increase over windows, paired
differences and KL ratios against a reference press, corrected minus uncorrected twins, win scores
over essays. The unit is the window: a sampling press's seeds are averaged within a window first,
then intervals are taken over windows (``evaluation.report.stats``); pairs are on the same windows.

``markdown(df, info)`` is the report; ``kvprob prose report`` writes it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.report import stats
from evaluation.report.aggregate import REFERENCE, win_scores
from evaluation.report.tables import markdown_table
from evaluation.store import manifest
from evaluation.store.results import load_folders, results_files
from kvpress_prob.names.registry import is_sampling

VALUES = ("kl", "nll_delta")
NOCORR = "_nocorr"


# --------------------------------------------------------------------------- loading


def load(paths) -> tuple[pd.DataFrame, dict]:
    """(the records of the results folders or files ``paths``, what their manifests say: split,
    context_length, scored_tokens, the commands run). Folders of several splits or lengths are refused."""
    files = [f for p in paths for f in results_files(p)]
    df = load_folders(paths)
    if df.empty:
        raise FileNotFoundError(f"no prose records in {', '.join(str(p) for p in paths)}")
    manifests = [m for m in (manifest.read(f) for f in files) if m is not None]
    info = {"commands": [r.get("command") for m in manifests for r in m["runs"] if r.get("command")]}
    for field in ("split", "context_length", "scored_tokens"):
        values = sorted({m["identity"].get(field) for m in manifests} - {None}, key=str)
        if len(values) > 1:
            raise manifest.ManifestMismatch(f"the results mix {field} values {values}: report each on its own")
        info[field] = values[0] if values else None
    if info["split"] is None and "split" in df:
        info["split"] = "/".join(sorted(df["split"].dropna().unique()))
    return df, info


def complete_windows(df: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """(the rows of the windows on which every (press, ratio, seed) of the frame ran, the number of
    windows left out): every comparison is then on the same windows."""
    cells = df.groupby("example_id").apply(lambda g: set(zip(g["press"], g["compression_ratio"], g["seed"])),
                                           include_groups=False)
    wanted = set().union(*cells) if len(cells) else set()
    keep = cells[cells.map(lambda c: c >= wanted)].index
    return df[df["example_id"].isin(keep)], int(len(cells) - len(keep))


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    """Typed columns and ``held``: bytes held (keys, values and a SamplingPress's correction bias) over
    the full cache's keys and values on the same window."""
    out = df.copy()
    out["compression_ratio"] = out["compression_ratio"].astype(float).round(6)
    out["seed"] = out["seed"].fillna(0).astype(int)
    out["example_id"] = out["example_id"].astype(str)
    full = out[out["press"] == REFERENCE].groupby("example_id")["kv_bytes"].first()
    out["held"] = (out["kv_bytes"] + out["bias_bytes"]) / out["example_id"].map(full)
    return out


# --------------------------------------------------------------------------- tables


def references(df: pd.DataFrame, reference: str | None = None, value: str = "kl") -> dict[float, str]:
    """The reference press at each ratio: ``reference`` if given, else the deterministic (top-k)
    press with the lowest mean ``value`` over windows there, chosen on the windows it is compared on (a
    minimum of noisy means: it favours top-k); ties go to the first press name."""
    ratios = sorted(df.loc[df["press"] != REFERENCE, "compression_ratio"].unique())
    if reference is not None:
        if reference not in set(df["press"]):
            raise ValueError(f"reference must be a press of the results ({', '.join(sorted(set(df['press'])))}), "
                             f"got {reference!r}")
        return {r: reference for r in ratios}
    topk = df[(df["press"] != REFERENCE) & ~df["press"].map(_sampling)]
    if topk.empty:
        raise ValueError("no deterministic press in the results to compare with: pass reference=")
    means = stats.mean_table(topk, value, by=["compression_ratio", "press"])
    return {r: g.sort_values(["mean", "press"]).iloc[0]["press"] for r, g in means.groupby("compression_ratio")}


def _sampling(press: str) -> bool:
    try:
        return is_sampling(press)
    except (KeyError, ValueError):  # a label with overrides, or not a registry name
        return False


def summary(df: pd.DataFrame, refs: dict[float, str]) -> pd.DataFrame:
    """One row per (ratio, press): KL and NLL increase (mean, t-interval over windows), the press
    minus the reference paired over windows (KL and NLL increase, windows where lower), KL / reference
    KL (ratio of means, paired bootstrap interval), held and realised ratio, seconds per configuration."""
    rows = []
    for ratio, ref, at, press, g, means in press_groups(df, refs, VALUES):
        row = {"compression_ratio": ratio, "press": press, "reference": ref, "windows": g["example_id"].nunique(),
               "essays": g["task"].nunique(), "seeds": g["seed"].nunique(), "held": g["held"].mean(),
               "realised_ratio": g["realised_ratio"].mean(), "seconds": g["seconds"].mean()}
        for v in VALUES:
            row |= mean_cells(means[v], v, press)
            if press != ref:
                d = stats.paired_table(at, v, "press", press, ref).iloc[0]
                row |= {f"{v}_diff": d["mean"], f"{v}_diff_lo": d["lo"], f"{v}_diff_hi": d["hi"],
                        f"{v}_lower": int(d["a_better"]), "pairs": int(d["n"])}
        rows.append(row | kl_ratio_cells(means["kl"], press, ref))
    return pd.DataFrame(rows).sort_values(["compression_ratio", "kl", "press"], ignore_index=True)


def press_groups(df: pd.DataFrame, refs: dict[float, str], values):
    """The loop of a summary table (prose and recall alike): per compression ratio and press, the full
    cache left out, (ratio, its reference press, the rows at the ratio, press, its rows, for each of
    ``values`` the window means of every press at the ratio: ``stats.example_means``)."""
    for ratio, at in df[df["press"] != REFERENCE].groupby("compression_ratio"):
        means = {v: stats.example_means(at, v, ["press"]) for v in values}
        for press, g in at.groupby("press"):
            yield ratio, refs[ratio], at, press, g, means


def mean_cells(means: pd.DataFrame, v: str, press: str) -> dict:
    """{v, v_lo, v_hi}: the mean over windows of ``press``'s window means of ``v`` (``means``: the window
    means of every press) with its t-interval."""
    ci = stats.mean_ci(means[means["press"] == press][v])
    return {v: ci["mean"], f"{v}_lo": ci["lo"], f"{v}_hi": ci["hi"]}


def kl_ratio_cells(kl_means: pd.DataFrame, press: str, ref: str) -> dict:
    """{kl_ratio, kl_ratio_lo, kl_ratio_hi}: ``press``'s mean KL over the reference's on the windows both
    ran (ratio of means, paired bootstrap interval: ``stats.ratio_ci``), from the window means."""
    kl, ref_kl = (kl_means[kl_means["press"] == p].set_index("example_id")["kl"] for p in (press, ref))
    both = pd.concat([kl, ref_kl], axis=1, join="inner").to_numpy()
    r = stats.ratio_ci(both[:, 0], both[:, 1])
    return {"kl_ratio": r["ratio"], "kl_ratio_lo": r["lo"], "kl_ratio_hi": r["hi"]}


def twins(df: pd.DataFrame) -> pd.DataFrame:
    """Every press X with its uncorrected twin X_nocorr in the frame: X minus X_nocorr per ratio, paired
    over windows (KL and NLL increase)."""
    presses = set(df["press"])
    rows = []
    for twin in sorted(p for p in presses if p.endswith(NOCORR) and p.removesuffix(NOCORR) in presses):
        press = twin.removesuffix(NOCORR)
        for v in VALUES:
            part = stats.paired_table(df, v, "press", press, twin, by=["compression_ratio"])
            rows += [row | {"value": v} for row in part.to_dict("records")]
    return pd.DataFrame(rows)


def wins(df: pd.DataFrame) -> pd.DataFrame:
    """Win scores over essays (``evaluation.report.aggregate.win_scores``; a unit is one essay at one ratio,
    scored by minus the mean over its windows and seeds), by KL and by NLL increase, with ranks."""
    parts = []
    for v in VALUES:
        frame = df.assign(score=-df[v], dataset="prose")
        w = win_scores(frame[["model", "dataset", "task", "example_id", "press", "compression_ratio", "seed", "score"]])
        parts.append(w.set_index("press")[["win_score", "rank", "units"]].add_prefix(f"{v}_"))
    out = pd.concat(parts, axis=1).reset_index()
    return out.sort_values(["kl_rank", "press"], ignore_index=True)


# --------------------------------------------------------------------------- markdown


def _ci(mean, lo, hi, fmt="{:.4f}", signed=False) -> str:
    if pd.isna(mean):
        return "–"
    f = fmt.replace("{:", "{:+") if signed else fmt
    if pd.isna(lo):
        return f.format(mean)
    return f"{f.format(mean)} [{f.format(lo)}, {f.format(hi)}]"


def _ratio_table(s: pd.DataFrame) -> pd.DataFrame:
    ref = s["reference"].iloc[0]
    table = pd.DataFrame({
        "press": s["press"],
        "KL": [_ci(r.kl, r.kl_lo, r.kl_hi) for r in s.itertuples()],
        f"KL / {ref}": [_ci(r.kl_ratio, r.kl_ratio_lo, r.kl_ratio_hi, "{:.2f}") for r in s.itertuples()],
        f"KL − {ref} (lower)": ["–" if r.press == ref else _ci(r.kl_diff, r.kl_diff_lo, r.kl_diff_hi, signed=True)
                                + f" ({r.kl_lower:.0f}/{r.pairs:.0f})" for r in s.itertuples()],
        "ΔNLL": [_ci(r.nll_delta, r.nll_delta_lo, r.nll_delta_hi, signed=True) for r in s.itertuples()],
        f"ΔNLL − {ref} (lower)": ["–" if r.press == ref else
                                  _ci(r.nll_delta_diff, r.nll_delta_diff_lo, r.nll_delta_diff_hi, signed=True)
                                  + f" ({r.nll_delta_lower:.0f}/{r.pairs:.0f})" for r in s.itertuples()],
        "held": [f"{h:.3f}" for h in s["held"]],
        "s/config": [f"{x:.2f}" for x in s["seconds"]],
    }).set_index("press")
    return table


def _twin_table(t: pd.DataFrame) -> pd.DataFrame:
    t = t.assign(cell=[_ci(r.mean, r.lo, r.hi, signed=True) + f" ({r.a_better}/{r.n})" for r in t.itertuples()],
                 column=[f"{'KL' if v == 'kl' else 'ΔNLL'} r = {r:g}" for v, r in zip(t["value"], t["compression_ratio"])])
    wide = t.pivot(index="a", columns="column", values="cell")
    wide.index.name = "corrected − uncorrected (windows where lower)"
    return wide[sorted(wide.columns, key=lambda c: (not c.startswith("KL"), c))]


def leaders(s: pd.DataFrame) -> pd.DataFrame:
    """Per ratio, the lowest mean KL among the top-k presses, the corrected sampling presses and the
    uncorrected ones (``_nocorr``), each with its KL ratio and paired difference to the reference. A
    maximum over noisy means: on a development split this is a choice, not a result."""
    rows = []
    for ratio, part in s.groupby("compression_ratio"):
        sampled = part["press"].map(_sampling)
        kinds = {"top-k": part[~sampled], "sampled, corrected": part[sampled & ~part["press"].str.endswith(NOCORR)],
                 "sampled, uncorrected": part[sampled & part["press"].str.endswith(NOCORR)]}
        for kind, group in kinds.items():
            if not group.empty:
                rows.append(group.sort_values(["kl", "press"]).iloc[0].to_dict() | {"kind": kind})
    return pd.DataFrame(rows)


def _leader_table(lead: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "r": [f"{r:g}" for r in lead["compression_ratio"]], "kind": lead["kind"], "press": lead["press"],
        "KL": [_ci(r.kl, r.kl_lo, r.kl_hi) for r in lead.itertuples()],
        "KL / reference": [f"{_ci(r.kl_ratio, r.kl_ratio_lo, r.kl_ratio_hi, '{:.2f}')} ({r.reference})"
                           for r in lead.itertuples()],
        "ΔNLL": [_ci(r.nll_delta, r.nll_delta_lo, r.nll_delta_hi, signed=True) for r in lead.itertuples()],
    }).set_index("r")


def overview(s: pd.DataFrame, w: pd.DataFrame) -> pd.DataFrame:
    """One row per press, best KL win score first: mean KL and KL / reference at each ratio, ΔNLL at
    each ratio, the bytes held at the largest ratio, the win scores by KL and by ΔNLL."""
    ratios = sorted(s["compression_ratio"].unique())
    by = s.set_index(["press", "compression_ratio"])
    rows = []
    for r in w.itertuples():
        row = {"press": r.press}
        for ratio in ratios:
            x = by.loc[(r.press, ratio)] if (r.press, ratio) in by.index else None
            row[f"KL r={ratio:g}"] = "–" if x is None else f"{x['kl']:.4f}"
            row[f"×ref r={ratio:g}"] = "–" if x is None else _ci(x["kl_ratio"], x["kl_ratio_lo"], x["kl_ratio_hi"], "{:.2f}")
        for ratio in ratios:
            x = by.loc[(r.press, ratio)] if (r.press, ratio) in by.index else None
            row[f"ΔNLL r={ratio:g}"] = "–" if x is None else f"{x['nll_delta']:+.4f}"
        last = by.loc[(r.press, ratios[-1])] if (r.press, ratios[-1]) in by.index else None
        row[f"held r={ratios[-1]:g}"] = "–" if last is None else f"{last['held']:.3f}"
        row["win KL (rank)"] = f"{r.kl_win_score:.3f} ({r.kl_rank})"
        row["win ΔNLL (rank)"] = f"{r.nll_delta_win_score:.3f} ({r.nll_delta_rank})"
        rows.append(row)
    return pd.DataFrame(rows).set_index("press")


def markdown(df: pd.DataFrame, info: dict, reference: str | None = None) -> str:
    """The report: settings, per-ratio tables against the reference, twins, win scores."""
    df, dropped = complete_windows(prepare(df))
    refs = references(df, reference)
    s = summary(df, refs)
    split = info.get("split") or "?"
    n_windows, n_essays = df["example_id"].nunique(), df["task"].nunique()
    seeds = sorted(df.loc[df["press"].map(_sampling), "seed"].unique().tolist())
    full = stats.mean_ci(df[df["press"] == REFERENCE].groupby("example_id")["nll_full"].first())
    lines = [f"# Prose benchmark: {split} split, n = {info.get('context_length')}, T = {info.get('scored_tokens')}", "",
             f"Split: **{split}**. {n_windows} windows of {n_essays} essays"
             + (f" ({dropped} incomplete windows left out)" if dropped else "")
             + f"; sampling presses over seeds {seeds} (averaged within a window first), deterministic ones once. "
             f"Intervals: 95 %, Student-t over windows; KL ratios: ratio of the mean KLs, paired bootstrap over "
             f"windows. KL = KL(full ‖ press) per scored token (nats); ΔNLL = NLL per token under the press minus "
             f"under the full cache (nats). The full cache's NLL: {_ci(full['mean'], full['lo'], full['hi'], '{:.3f}')} "
             f"nats per token. Held: bytes held (keys, values and the correction bias of a SamplingPress) over the "
             f"full cache's; s/config: seconds to compress and score one configuration (the shared prefill not included).",
             ""]
    for command in dict.fromkeys(info.get("commands") or []):
        lines.append(f"Command: `{command}`")
    lines += ["", "## Lowest KL of each kind (on this split: a choice, not a result)", "",
              markdown_table(_leader_table(leaders(s))), ""]
    ov = overview(s, wins(df))
    ov.index.name = "press (by KL win score)"
    refs_text = ", ".join(f"r = {r:g}: {p}" for r, p in refs.items())
    lines += [f"## Overview (×ref: KL / the reference's KL, {refs_text}; win scores over essays × ratios)", "",
              markdown_table(ov), ""]
    for ratio, part in s.groupby("compression_ratio"):
        ref = refs[ratio]
        how = "given" if reference else "the top-k press with the lowest mean KL here"
        lines += [f"## r = {ratio:g}: against {ref} ({how}), paired over windows", "", markdown_table(_ratio_table(part)), ""]
    t = twins(df)
    if not t.empty:
        lines += ["## Correction: each press minus its uncorrected twin, paired over windows", "",
                  markdown_table(_twin_table(t)), ""]
    w = wins(df).set_index("press")
    w.index.name = "press"
    lines += [f"## Win scores over essays ({n_essays} essays × {len(refs)} ratios; "
              "by KL and by ΔNLL)", "", markdown_table(w, float_format="{:.3f}"), ""]
    return "\n".join(lines)


def write(paths, out: Path | None = None, reference: str | None = None) -> tuple[Path, str]:
    """Write ``report.md`` and ``summary.csv`` for the results ``paths`` (into ``out``; default the
    first folder). Returns (report path, its text)."""
    return write_essay_tables(paths, out, reference, markdown, summary, references)


def write_essay_tables(paths, out, reference, markdown, summary, references) -> tuple[Path, str]:
    """Write ``report.md`` (``markdown(df, info, reference)``) and ``summary.csv`` (``summary`` of the
    complete windows against ``references(df, reference)``) for the results ``paths`` into ``out``
    (None: the first results folder); prose and recall alike. Returns (report path, its text)."""
    from evaluation.store.results import write_atomic

    df, info = load(paths)
    text = markdown(df, info, reference)
    first = Path(paths[0])
    out = Path(out) if out else (first if first.is_dir() else first.parent)
    prepared, _ = complete_windows(prepare(df))
    write_atomic(out / "summary.csv", summary(prepared, references(prepared, reference)).to_csv(index=False))
    return write_atomic(out / "report.md", text), text


__all__ = ["load", "complete_windows", "prepare", "references", "summary", "press_groups", "mean_cells", "kl_ratio_cells", "leaders", "overview", "twins", "wins", "markdown", "write", "write_essay_tables"]
