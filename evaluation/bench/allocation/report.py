"""The allocation bench's summary and outputs: ``budget.md``, ``budget.json``, ``kept_heatmap.png``, ``per_layer.png``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.bench import common
from evaluation.bench.allocation.measure import SCOPES


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    g = rows.groupby(["proposal", "scope", "target"])
    table = pd.DataFrame({
        "draws": g.size(),
        "mean realised": g.realised_ratio.mean(),
        "mean signed dev": g.deviation.mean(),
        "mean abs dev": g.deviation.apply(lambda d: d.abs().mean()),
        "max abs dev": g.deviation.apply(lambda d: d.abs().max()),
        "kept frac": g.kept_total_fraction.mean(),
        "stored frac": g.stored_fraction.mean(),
        "padding (mean over layers)": g.padding_mean_layer.mean(),
        "padding (overall)": g.padding_overall.mean(),
    })
    table["draws"] = table["draws"].astype(str)  # keeps the markdown cell an integer
    return table


def per_layer(rows: pd.DataFrame, heat: dict, ratio: float) -> pd.DataFrame:
    """Kept fraction (mean over heads) and padding factor per layer at ``ratio``, global scope."""
    cols = {}
    for (name, scope, r), h in heat.items():
        if scope == "global" and r == ratio:
            cols[f"{name} kept"] = h.mean(axis=1)
    sub = rows[(rows.scope == "global") & (rows.target == ratio)]
    for name, grp in sub.groupby("proposal"):
        cols[f"{name} padding"] = np.mean(np.stack(grp.padding_layer.map(np.asarray).tolist()), axis=0)
    frame = pd.DataFrame(cols)
    frame.index.name = "layer"
    return frame


def plot(heat: dict, proposals, ratio: float, scope_press: str, out: Path, layers: pd.DataFrame) -> list[Path]:
    from matplotlib.figure import Figure

    paths = []
    panels = [(p, "global") for p in proposals] + [(scope_press, s) for s in SCOPES if s != "global"]
    panels = [p for p in panels if (p[0], p[1], ratio) in heat]
    vmax = max(float(heat[(p, s, ratio)].max()) for p, s in panels)
    fig = Figure(figsize=(2.4 * len(panels) + 1, 6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for i, (ax, (p, s)) in enumerate(zip(axes, panels)):
        h = heat[(p, s, ratio)]
        im = ax.imshow(h, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, origin="lower")
        ax.set(title=f"{p}\n{s} (mean {h.mean():.3f})", xlabel="KV head", ylabel="layer" if i == 0 else None)
        ax.title.set_fontsize(8)
        ax.set_xticks(range(h.shape[1]))
    fig.colorbar(im, ax=list(axes), label=f"kept fraction at r={ratio}")
    paths.append(common.save_png(fig, out / "kept_heatmap.png"))

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    names = list(dict.fromkeys(col.rsplit(" ", 1)[0] for col in layers.columns))
    colour = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per proposal in both panels
    for col in layers.columns:
        ax = ax1 if col.endswith("kept") else ax2
        name = col.rsplit(" ", 1)[0]
        ax.plot(layers.index, layers[col], marker=".", label=name, color=colour[name])
    ax1.axhline(1 - ratio, color="k", lw=0.8, ls="--")
    ax1.set(xlabel="layer", ylabel="kept fraction (mean over heads)", title=f"Kept per layer, r={ratio}, global")
    ax2.set(xlabel="layer", ylabel="H * stored / kept", title="Padding factor per layer")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(common.save_png(fig, out / "per_layer.png"))
    return paths


def replot(out: Path) -> list[Path]:
    """Redraw the figures from ``<out>/budget.json`` (no model run)."""
    data = json.loads((out / "budget.json").read_text())
    settings = data["settings"]
    heat = {}
    for key, h in data["heatmaps"].items():
        p, s, r = key.split("|")
        heat[(p, s, float(r))] = np.asarray(h)
    layers = pd.DataFrame(data["per_layer"]).drop(columns="index", errors="ignore").set_index("layer")
    return plot(heat, settings["proposals"], settings["ratio"], settings["scope_press"], out, layers)


def markdown(table, layers, press_rows, info, settings) -> str:
    t = table.reset_index()
    glob = t[t.scope == "global"].drop(columns="scope").set_index("proposal")
    scopes = t[t.proposal == settings["scope_press"]].drop(columns="proposal").set_index("scope")
    lay = layers.copy()
    lay_summary = pd.DataFrame({
        "kept: min layer": lay[[c for c in lay if c.endswith("kept")]].min(),
        "kept: max layer": lay[[c for c in lay if c.endswith("kept")]].max(),
        "layer 0 kept": lay[[c for c in lay if c.endswith("kept")]].iloc[0],
        "last layer kept": lay[[c for c in lay if c.endswith("kept")]].iloc[-1],
    })
    lay_summary.index = [i.removesuffix(" kept") for i in lay_summary.index]
    lay_summary.index.name = "proposal"
    pr = press_rows.groupby("proposal").agg(
        examples=("example", "size"), realised=("realised_ratio", "mean"), padding=("padding", "mean"),
        redraw_matches=("redraw_matches_press", "all"))
    return "\n".join([
        "# Allocation benchmark (`python -m evaluation.bench budget`)\n",
        f"Model: {settings['model'] or 'embedded SmolLM2-135M-Instruct'}; {settings['examples']} RULER examples at "
        f"{settings['length']} tokens; targets r in {settings['ratios']}; {settings['seeds']} draws per example "
        f"and setting (one engine prefill per proposal and example; the other draws redone on its proposals by "
        f"the press's own sampler, see `evaluation/bench/allocation/__init__.py`).\n",
        common.machine_markdown(info),
        "## Realised vs target ratio, padding (global budget)\n",
        common.markdown_table(glob, float_format="{:.4f}"),
        "\n'dev' = realised - target compression ratio per draw; 'kept frac' and 'stored frac' are fractions of "
        "the full cache (L * H * n entries); padding = stored / kept.\n",
        f"## Scopes of {settings['scope_press']}\n",
        common.markdown_table(scopes, float_format="{:.4f}"),
        f"\n## Where the budget goes (r = {settings['ratio']}, global)\n",
        common.markdown_table(lay_summary, float_format="{:.3f}"),
        "\nPer layer (kept fraction averaged over heads, examples and draws; padding factor H*stored/kept):\n",
        common.markdown_table(lay, float_format="{:.3f}"),
        "\n## The real prefills (press.stats)\n",
        common.markdown_table(pr, float_format="{:.4f}"),
        "\nPlots: `kept_heatmap.png` (layer x KV head kept fraction per proposal, and the layer/head scopes of "
        f"{settings['scope_press']}), `per_layer.png`.\n",
    ])
