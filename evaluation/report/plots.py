"""The report's matplotlib figures: score against ratio per task, the averages, the win scores; one colour per press
in every figure. Plots use the Agg canvas directly (no pyplot state) and are written atomically."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from evaluation.report.aggregate import REFERENCE
from evaluation.store.results import write_atomic


def press_order(presses) -> list[str]:
    """The reference first, then the methods alphabetically."""
    presses = set(presses)
    return ([REFERENCE] if REFERENCE in presses else []) + sorted(presses - {REFERENCE})



def colours(presses) -> dict[str, tuple]:
    """A fixed colour per method, the same in every plot."""
    from matplotlib import colormaps

    methods = [p for p in press_order(presses) if p != REFERENCE]
    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {p: cmap(i % cmap.N) for i, p in enumerate(methods)}


def save_png(fig: Figure, path: Path) -> Path:
    """Render a figure to PNG and write it atomically."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return write_atomic(path, buffer.getvalue())


def _grid(n: int, max_cols: int = 4) -> tuple[int, int]:
    """Rows and columns for n panels."""
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


def plot_panels(panels: list[tuple[str, pd.DataFrame]], title: str, colours: dict, path: Path) -> Path:
    """One panel per (label, table): score vs ratio per method, the reference dashed."""
    rows, cols = _grid(len(panels))
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (label, table) in zip(axes, panels):
        ref = table[table["press"] == REFERENCE]
        if not ref.empty:
            ax.axhline(ref["score"].mean(), color="black", linestyle="--", linewidth=1, label="full cache")
        for press, rows_ in table[table["press"] != REFERENCE].groupby("press"):
            rows_ = rows_.sort_values("compression_ratio")
            ax.errorbar(rows_["compression_ratio"], rows_["score"], yerr=rows_["score_std"],
                        marker="o", markersize=3, capsize=2, linewidth=1.2, color=colours.get(press),
                        label=press)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("compression ratio")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:len(panels)]:  # collect methods missing from the first panel
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, path)


def plot_win_scores(wins: pd.DataFrame, path: Path, title: str = "Win score") -> Path:
    """Horizontal bars of the overall win score; a second bar per method without
    uninformative tasks when ``wins`` has a 'tasks' column with both variants."""
    overall = wins[wins["scope"] == "overall"] if "scope" in wins else wins
    variants = list(dict.fromkeys(overall["tasks"])) if "tasks" in overall else ["all"]
    first = overall[overall["tasks"] == variants[0]] if "tasks" in overall else overall
    order = first.sort_values("win_score")["press"].tolist()
    fig = Figure(figsize=(6.5, 0.45 * len(order) + 1.5))
    ax = fig.subplots()
    height = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        part = overall[overall["tasks"] == variant] if "tasks" in overall else overall
        values = part.set_index("press")["win_score"].reindex(order)
        ax.barh([y + i * height for y in range(len(order))], values.fillna(0).to_numpy(),
                height=height, label=f"{variant} tasks")
    ax.set_yticks([y + height * (len(variants) - 1) / 2 for y in range(len(order))], order)
    ax.set_xlim(0, 1)
    ax.set_xlabel("win score (share of pairwise comparisons won)")
    ax.axvline(0.5, color="grey", linewidth=0.8, linestyle=":")
    if len(variants) > 1:
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    return save_png(fig, path)
