"""Presses side by side on the three regimes' records, with paired differences, in each regime's own unit.

RULER: the score (points); prose: the mean KL to the full cache over h2o's at the same ratio (lower is better);
recall: the token accuracy (%). Each regime's table is taken over the examples every listed press ran there
(seeds averaged within an example first). A pair ``a:b`` is compared on the examples both ran: RULER and recall
as the mean difference a - b with its paired 95 % t-interval (``evaluation.report.stats.paired_difference``),
prose as mean KL(a) / mean KL(b) with its paired 95 % bootstrap interval (``ratio_ci``).

    python -m experiments.ragged_targets --ruler D... --prose D... --recall D... --presses P... \\
        --pairs a:b ... --ratios 0.5 0.75 0.9 --split test --out results/rule/test-targets-round4.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from evaluation.report.maximin_table import frame
from evaluation.report.stats import paired_difference, ratio_ci
from evaluation.report.tables import markdown_table
from evaluation.store.results import write_atomic

VALUE = {"ruler": "score", "prose": "kl", "recall": "acc"}
UNIT = {"ruler": "RULER score", "prose": "prose KL over h2o's", "recall": "recall token accuracy %"}


def per_example(df: pd.DataFrame, value: str) -> pd.DataFrame:
    """(example_id) x (press, ratio): ``value`` averaged over seeds."""
    return df.groupby(["press", "compression_ratio", "example_id"])[value].mean().unstack(["press", "compression_ratio"])


def levels(df: pd.DataFrame, regime: str, presses: list[str], ratios: list[float]) -> tuple[pd.DataFrame, int]:
    """press x ratio means over the examples every press (and h2o, for prose) ran at every ratio; their count.
    ``full`` (the full cache) is the same record at every ratio."""
    wanted = presses + (["h2o"] if regime == "prose" and "h2o" not in presses else [])
    full = df[df["press"] == "full"]  # the full cache, shown at every ratio
    df = pd.concat([df[df["press"] != "full"], *[full.assign(compression_ratio=r) for r in ratios]])
    wide = per_example(df[df["press"].isin(wanted) & df["compression_ratio"].isin(ratios)], VALUE[regime])
    missing = [(p, r) for p in wanted for r in ratios if (p, r) not in wide]
    if missing:
        raise ValueError(f"{regime}: no records of {missing}")
    wide = wide[[(p, r) for p in wanted for r in ratios]].dropna()
    means = wide.mean().unstack("compression_ratio")
    if regime == "prose":
        means = means / means.loc["h2o"]
    return means.loc[presses], len(wide)


def pair_row(df: pd.DataFrame, regime: str, a: str, b: str, ratio: float) -> dict:
    wide = per_example(df[df["press"].isin([a, b]) & (df["compression_ratio"] == ratio)], VALUE[regime])
    wide = wide[[(a, ratio), (b, ratio)]].dropna()
    x, y = wide[(a, ratio)].to_numpy(), wide[(b, ratio)].to_numpy()
    if regime == "prose":
        r = ratio_ci(x, y)
        return {"cell": f"{r['ratio']:.2f} × [{r['lo']:.2f}, {r['hi']:.2f}]", "n": r["n"]}
    d = paired_difference(x, y)
    return {"cell": f"{d['mean']:+.1f} [{d['lo']:+.1f}, {d['hi']:+.1f}]", "n": d["n"]}


def report(frames: dict[str, pd.DataFrame], presses: list[str], pairs: list[tuple[str, str]], ratios: list[float],
           split: str, command: str) -> str:
    lines = [f"# Presses side by side, {split} split", "", f"Command: `{command}`", ""]
    for regime, df in frames.items():
        means, n = levels(df, regime, presses, ratios)
        unit = "windows" if regime != "ruler" else "examples"
        digits = 2 if regime == "prose" else 1
        shown = means.map(lambda v: f"{v:.{digits}f}")
        shown.columns = [f"r = {r:g}" for r in shown.columns]
        lines += [f"## {UNIT[regime]} ({split}, {n} {unit} every press ran)", "", markdown_table(shown.rename_axis("press")), ""]
        if pairs:
            label = "a / b" if regime == "prose" else "a − b"
            rows = {f"`{a}` vs `{b}`": {f"r = {r:g} (n)": "{cell} ({n})".format(**pair_row(df, regime, a, b, r))
                                       for r in ratios} for a, b in pairs}
            what = "KL(a) / KL(b), paired bootstrap 95 %" if regime == "prose" else "a − b, paired t 95 %"
            table = pd.DataFrame.from_dict(rows, orient="index").rename_axis(label)
            lines += [f"Paired ({what}; n {unit} both ran):", "", markdown_table(table), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m experiments.ragged_targets", description=__doc__.split("\n")[0])
    for regime in VALUE:
        p.add_argument(f"--{regime}", nargs="+", required=True, help=f"{regime} results folders")
    p.add_argument("--presses", nargs="+", required=True)
    p.add_argument("--pairs", nargs="*", default=[], help="a:b, compared on the examples both ran")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75, 0.9])
    p.add_argument("--split", required=True, choices=["dev", "test"])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    pairs = []
    for text in args.pairs:
        a, sep, b = text.partition(":")
        if not (sep and a and b):
            raise SystemExit(f"--pairs takes a:b, got {text!r}")
        pairs.append((a, b))
    frames = {regime: frame(getattr(args, regime)) for regime in VALUE}
    command = "python -m experiments.ragged_targets " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(frames, args.presses, pairs, args.ratios, args.split, command)
    write_atomic(Path(args.out), text + "\n")
    return text


if __name__ == "__main__":
    print(main())
