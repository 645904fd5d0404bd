"""The oracle bench's summary tables and plot."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.bench import common


def summarise(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    opt = rows[rows.method == "opt_now"].set_index(["n", "instance"]).err_now
    opt_l = rows[rows.method == "opt_later"].set_index(["n", "instance"]).err_later
    r = rows.set_index(["n", "instance"]).copy()
    r["ratio_now"] = r.err_now / opt.reindex(r.index).values
    r["ratio_later"] = r.err_later / opt_l.reindex(r.index).values
    g = r.reset_index().groupby(["n", "method"], sort=False)
    mean = g[["err_now", "err_later"]].mean()
    table = pd.DataFrame({
        "err now": mean.err_now,
        "rel now": mean.err_now / mean.err_now.xs("opt_now", level="method").reindex(mean.index.get_level_values("n")).values,
        "median ratio now": g.ratio_now.median(),
        "err later": mean.err_later,
        "rel later": mean.err_later / mean.err_later.xs("opt_later", level="method").reindex(mean.index.get_level_values("n")).values,
        "median ratio later": g.ratio_later.median(),
    })
    first = rows[rows.method == "topk"].groupby("n")
    overlap = pd.DataFrame({
        "Jaccard(opt_now, opt_later)": first.jaccard_now_later.mean(),
        "opt_now == opt_later": first.jaccard_now_later.apply(lambda j: (j == 1).mean()),
        "Jaccard(topk, opt_now)": first.jaccard_topk_now.mean(),
        "Jaccard(topk, opt_later)": first.jaccard_topk_later.mean(),
        "topk == opt_now": first.topk_is_opt_now.mean(),
        "sampled kept: mean": first.kept_mean.mean(),
        "sampled kept: std": first.kept_std.mean(),
        "|o(q_t)| mean": first.full_norm_now.mean(),
    })
    return table, overlap


def plot(table: pd.DataFrame, overlap: pd.DataFrame, out: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    t = table.reset_index()
    for method, grp in t.groupby("method", sort=False):
        ax1.plot(grp.n, grp["rel now"], marker="o", label=method)
        ax2.plot(grp.n, grp["rel later"], marker="o", label=method)
    ax1.set(xlabel="n (k = n/2)", ylabel="mean error / optimum's", title="At the eviction query q_t", yscale="log")
    ax2.set(xlabel="n (k = n/2)", ylabel="mean error / optimum's", title="Mean over later queries", yscale="log")
    ax1.legend(fontsize=7)
    for col in ["Jaccard(opt_now, opt_later)", "Jaccard(topk, opt_now)", "Jaccard(topk, opt_later)"]:
        ax3.plot(overlap.index, overlap[col], marker="o", label=col)
    ax3.set(xlabel="n", ylabel="Jaccard", title="Overlap of subsets", ylim=(0, 1.05))
    ax3.legend(fontsize=7)
    fig.tight_layout()
    return common.save_png(fig, out / "oracle.png")
