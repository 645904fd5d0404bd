"""The fidelity plots: KL bars with t-intervals, layer-wise error, bias^2 and variance against m."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from evaluation.bench.fidelity import FAMILIES
from evaluation.bench.fidelity.tables import loglog_slope
from evaluation.report.plots import save_png


def plot_kl_bars(summary: pd.DataFrame, path: Path, order: list) -> Path:
    ratios = sorted(summary["ratio"].unique())
    labels = [p for p in order if p in set(summary["press"])]
    fig = Figure(figsize=(max(7.0, 0.55 * len(labels) * max(1, len(ratios)) + 2), 4.8))
    ax = fig.subplots()
    width = 0.8 / max(1, len(ratios))
    for k, ratio in enumerate(ratios):
        part = summary[summary["ratio"] == ratio].set_index("press").reindex(labels)
        x = np.arange(len(labels)) + (k - (len(ratios) - 1) / 2) * width
        mean = part["kl"].to_numpy(dtype=float)
        lo = np.where(np.isfinite(part["kl_lo"]), mean - np.maximum(part["kl_lo"].to_numpy(dtype=float), 0.0), 0.0)
        hi = np.where(np.isfinite(part["kl_hi"]), part["kl_hi"].to_numpy(dtype=float) - mean, 0.0)
        ax.bar(x, mean, width=width, yerr=np.vstack([np.maximum(lo, 0), np.maximum(hi, 0)]), capsize=3,
               label=f"ratio {ratio:g}")
    ax.set_xticks(np.arange(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("KL(full || compressed), nats / token")
    positive = summary["kl"][summary["kl"] > 0]
    if len(positive) and positive.max() / max(positive.min(), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_title("End-to-end KL to the full cache (mean over examples, 95% t-CI clipped at 0)", fontsize=10)
    if len(ratios) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def plot_layer_error(layers: pd.DataFrame, path: Path, order: list) -> Path | None:
    main = layers[(layers["temperature"] == 1.0) & layers["main"]]
    if main.empty:
        return None
    ratios = sorted(main["ratio"].unique())
    fig = Figure(figsize=(6.0 * len(ratios), 4.6))
    axes = np.atleast_1d(fig.subplots(1, len(ratios), squeeze=False)[0])
    styles = {"top-k": "-", "sampled": "--", "uncorrected": ":", "HT": "-."}
    role_of = {name: (fam, role) for fam, roles in FAMILIES.items() for role, name in roles.items()}
    colours = {fam: f"C{i}" for i, fam in enumerate(FAMILIES)}
    for ax, ratio in zip(axes, ratios):
        part = main[main["ratio"] == ratio].set_index("press")
        for k, label in enumerate(p for p in order if p in part.index):
            fam, role = role_of.get(label, (None, None))
            ax.plot(part.loc[label, "err_layers"], styles.get(role, "-"),
                    color=colours.get(fam, f"C{(k + 4) % 10}"), label=label, linewidth=1.3)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative L2 error of the attention output")
        ax.set_title(f"ratio {ratio:g}")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("Layer-wise attention error on the continuation (end to end, mean over examples)")
    fig.tight_layout()
    return save_png(fig, path)


def plot_bias_variance(layers: pd.DataFrame, path: Path) -> Path | None:
    """bias² (debiased) and variance of the attention output vs m, the number of draws (log-log,
    with the fitted slope: SNIS theory gives -2 for bias² and -1 for variance as m grows); vs the
    compression ratio when m is unknown."""
    samp = layers[layers["n_seeds"] > 1]
    methods = [m for m in dict.fromkeys(samp["method"]) if samp[samp["method"] == m]["ratio"].nunique() > 1
               or samp[samp["method"] == m]["temperature"].nunique() > 1]
    if not methods:
        return None
    fig = Figure(figsize=(5.5 * len(methods), 4.4))
    axes = np.atleast_1d(fig.subplots(1, len(methods), squeeze=False)[0])
    for ax, method in zip(axes, methods):
        part = samp[samp["method"] == method]
        by_m = "m_mean" in part and part["m_mean"].notna().all()
        for k, temperature in enumerate(sorted(part["temperature"].unique())):
            g = part[part["temperature"] == temperature].sort_values("m_mean" if by_m else "ratio")
            x = g["m_mean"] if by_m else g["ratio"]
            name = "inf" if math.isinf(temperature) else f"{temperature:g}"
            bias2 = g["bias2_debiased"].where(g["bias2_debiased"] > 0)
            b_label, v_label = f"bias² T={name}", f"variance T={name}"
            if by_m:
                b_label += f" (slope {loglog_slope(x, bias2):+.2f})"
                v_label += f" (slope {loglog_slope(x, g['var_mean']):+.2f})"
            ax.plot(x, bias2, "-o", color=f"C{k}", label=b_label, markersize=4)
            ax.plot(x, g["var_mean"], "--s", color=f"C{k}", label=v_label, markersize=4)
        ax.set_yscale("log")
        if by_m:
            ax.set_xscale("log")
        ax.set_xlabel("m, draws of the global budget (mean over examples)" if by_m else "compression ratio")
        ax.set_ylabel("relative squared error (mean over layers)")
        ax.set_title(method)
        ax.legend(fontsize=6, ncol=1)
    fig.suptitle("Debiased bias² and variance of the attention output over seeds")
    fig.tight_layout()
    return save_png(fig, path)

