"""The frontier plots, read from a maximin table's CSV (``evaluation.report.maximin_table``): each design's RULER
score against its prose KL over the regime's best press, recall as the marker's colour; and, with a price record
(``python -m evaluation.bench price``), each design's worst q against its prefill time over snapkv's.

    python -m evaluation.report.frontier results/rule/test-maximin-round4.csv   # writes results/rule/test-frontier.png
    python -m evaluation.report.frontier T.csv --price results/bench/price/price.jsonl   # and <split>-price.png
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


def plot_price(table: pd.DataFrame, record: pd.DataFrame, split: str, path: Path) -> Path:
    """Scatter of each press of ``table`` (a maximin table: ``worst``, ``worst_regime``, ``candidate``) that
    ``record`` (``evaluation.report.price.load``) prices: worst q against prefill time over snapkv's, the bar
    its range over rounds. Presses the record lacks are named under the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priced = table.index[table.index.isin(record.index)]
    rows = table.loc[priced].join(record[["prefill_over_snapkv", "prefill_over_snapkv_lo", "prefill_over_snapkv_hi"]])
    fig, ax = plt.subplots(figsize=(8, 6))
    x = rows["prefill_over_snapkv"]
    ax.errorbar(x, rows["worst"], xerr=[x - rows["prefill_over_snapkv_lo"], rows["prefill_over_snapkv_hi"] - x],
                fmt="none", ecolor="grey", lw=0.8)
    ax.scatter(x, rows["worst"], s=40, c=["tab:blue" if c else "tab:grey" for c in rows["candidate"]])
    for press, row in rows.iterrows():
        ax.annotate(f"{press} ({row['worst_regime']})", (row["prefill_over_snapkv"], row["worst"]), fontsize=6,
                    xytext=(3, 2), textcoords="offset points")
    ax.axvline(1.2, color="tab:red", lw=0.8, ls="--")
    ax.set_xscale("log")
    ticks = [t for t in (0.5, 1, 1.2, 1.5, 2, 3, 4, 6, 8, 12) if x.min() / 1.2 <= t <= x.max() * 1.2]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("prefill time over snapkv's (median [range] over rounds; dashed: 1.2, the fast presses' limit)")
    ax.set_ylabel("worst q over RULER, prose and recall (1 = the regime's best press)")
    ax.set_title(f"Quality against price, {split} split (blue: equal-memory candidate)")
    lacking = [p for p in table.index if p not in record.index]
    if lacking:
        fig.text(0.01, 0.005, "not priced: " + ", ".join(lacking), fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m evaluation.report.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("table", help="a maximin table's CSV, <split>-maximin.csv")
    p.add_argument("--out", default=None, help="unset: <split>-frontier.png beside the table")
    p.add_argument("--price", nargs="+", default=None,
                   help="price records (a press in several takes the first's row): also plot worst q against prefill time (--out's name with 'price' for 'frontier')")
    args = p.parse_args(argv)
    table_path = Path(args.table)
    split = table_path.name.split("-maximin")[0]
    out = Path(args.out) if args.out else table_path.with_name(f"{split}-frontier.png")
    table = pd.read_csv(table_path, index_col="press")
    print(plot_frontier(table, split, out))
    if args.price:
        from evaluation.report.price import combine, load

        record = combine([load(path) for path in args.price])
        print(plot_price(table, record, split, out.with_name(out.name.replace("frontier", "price"))))
    return out


if __name__ == "__main__":
    main()
