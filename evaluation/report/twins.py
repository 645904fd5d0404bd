"""Presses against their own twins, paired on examples: "top-k + summary" minus the same top-k, a
hybrid minus a top-k, at every ratio, over all tasks and on one task alone (fwe by default).

Each pair ``a:b`` gives a - b of the seed-averaged score per example, on the examples both ran, with
a 95 % t-interval (``evaluation.report.stats.paired_table``), and each arm's mean on those examples.

``python -m evaluation.report.twins --results runs/dev-1024 --split development --pairs keydiff_sum4:keydiff``
"""

from __future__ import annotations

import argparse

import pandas as pd

from evaluation.report.aggregate import prepare
from evaluation.report.pairs import pair_parser, publish
from evaluation.report.stats import paired_table
from evaluation.report.tables import markdown_table
from evaluation.store.results import load_folders


def _cell(row) -> str:
    if pd.isna(row["lo"]):
        return f"{row['mean']:+.1f} (n={row['n']})"
    return f"{row['mean']:+.1f} [{row['lo']:+.1f}, {row['hi']:+.1f}] ({row['mean_a']:.1f} vs {row['mean_b']:.1f})"


def pair_rows(df: pd.DataFrame, pairs: list[tuple[str, str]], task: str | None) -> pd.DataFrame:
    """One row per pair (and ``task`` alone as a second row): a - b per ratio, as text cells."""
    rows = []
    for a, b in pairs:
        for scope in [None, task] if task else [None]:
            frame = df if scope is None else df[df["task"] == scope]
            table = paired_table(frame, "score", "press", a, b, by=["compression_ratio"])
            if table.empty:
                continue
            n = int(table["n"].max())
            label = f"{a} − {b}" + (f" ({scope} only, {n} ex)" if scope else f" ({n} ex)")
            rows.append({"pair": label} | {f"r = {r:g}": _cell(row) for r, row in
                                           zip(table["compression_ratio"], table.to_dict("records"))})
    return pd.DataFrame(rows).set_index("pair") if rows else pd.DataFrame()


def markdown(df: pd.DataFrame, pairs: list[tuple[str, str]], split: str, task: str | None = "fwe") -> str:
    df = prepare(df)
    wide = pair_rows(df, pairs, task)
    lines = [f"# Paired differences ({split} split)", "",
             "Cells: mean of a − b over examples (seeds averaged within an example) [95 % t-interval] "
             "(mean of a vs mean of b on the same examples).", ""]
    lines += [markdown_table(wide) if not wide.empty else "(no shared examples)", ""]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = pair_parser("python -m evaluation.report.twins", __doc__.split("\n\n")[0])
    p.add_argument("--task", default="fwe", help="also report this task alone (default: fwe)")
    return p


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    return publish(markdown(load_folders(args.results), args.pairs, args.split, args.task), args.out)


if __name__ == "__main__":
    main()
