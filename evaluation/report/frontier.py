"""The frontier plot: each design's RULER score against its prose KL over the regime's best press, recall as
the marker's colour, read from a maximin table's CSV (``evaluation.report.maximin_table``).

    python -m evaluation.report.frontier results/rule/test-maximin.csv   # writes results/rule/test-frontier.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd



def plot_frontier(table: pd.DataFrame, split: str, path: Path) -> Path:
    """Scatter of ``table`` (a maximin table: ``q_ruler``, ``q_prose``, ``q_recall``, ``candidate`` per press)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 6))
    points = ax.scatter(1 / table["q_prose"], 100 * table["q_ruler"], c=table["q_recall"], cmap="viridis", s=40,
                        edgecolors=["black" if c else "none" for c in table["candidate"]])
    for press, row in table.iterrows():
        ax.annotate(press, (1 / row["q_prose"], 100 * row["q_ruler"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("prose: KL / the best press's KL (mean over ratios of its inverse q; lower is better)")
    ax.set_ylabel("RULER: score as % of the best press's (higher is better)")
    fig.colorbar(points, label="recall q: best KL / KL on the cued sentences")
    ax.set_title(f"Three regimes, {split} split (black edge: equal-memory candidate)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m evaluation.report.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("table", help="a maximin table's CSV, <split>-maximin.csv")
    p.add_argument("--out", default=None, help="unset: <split>-frontier.png beside the table")
    args = p.parse_args(argv)
    table_path = Path(args.table)
    split = table_path.name.split("-maximin")[0]
    out = Path(args.out) if args.out else table_path.with_name(f"{split}-frontier.png")
    print(plot_frontier(pd.read_csv(table_path, index_col="press"), split, out))
    return out


if __name__ == "__main__":
    main()
