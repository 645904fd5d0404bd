"""The no-regression clause of the rule of 2026-12-06: each candidate's q minus the incumbent's, per regime, paired.

For each regime, the q of a press (as ``evaluation.report.maximin``: RULER mean / best mean, KL best / KL, the best
press of the pool per ratio) averaged over the ratios, minus the incumbent's, with a paired percentile-bootstrap
95 % interval over the examples every press of the regime ran (seeds averaged within an example; the best press
and the ratios resampled with the same examples). A candidate is refused for a role when an interval lies wholly
below 0.

    python -m experiments.no_regression --incumbent topk_gate_layers_recent25 \\
        --candidates topk_gate_profile_ragged ... --ruler ... --prose ... --recall ... --out results/rule/...md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.report.maximin import REGIMES, complete
from evaluation.report.maximin_table import pool
from evaluation.report.tables import markdown_table
from evaluation.engine.runner import REFERENCE

DRAWS = 2000


def q_of(per: pd.DataFrame, ratios, higher: bool, columns=None) -> pd.Series:
    """press -> q averaged over ``ratios`` on the examples ``columns`` of ``per`` ((press, ratio) x example)."""
    at = per if columns is None else per.iloc[:, columns]
    m = at.mean(axis=1).unstack("compression_ratio")[list(ratios)]  # press x ratio
    q = m / m.max() if higher else m.min() / m
    return q.mean(axis=1)


def differences(frames: dict[str, pd.DataFrame], incumbent: str, candidates: list[str], ratios, seed: int = 0
                ) -> pd.DataFrame:
    """One row per (candidate, regime): q, the incumbent's q, their difference and its paired 95 % interval."""
    rng = np.random.default_rng(seed)
    rows = []
    for regime, (value, higher) in REGIMES.items():
        df = frames[regime]
        df = complete(df[df["compression_ratio"].round(6).isin(ratios) & (df["press"] != REFERENCE)])
        per = df.groupby(["press", "compression_ratio", "example_id"])[value].mean().unstack("example_id")
        n = per.shape[1]
        q = q_of(per, ratios, higher)
        draws = [q_of(per, ratios, higher, rng.integers(0, n, n)) for _ in range(DRAWS)]
        for press in candidates:
            d = np.array([x[press] - x[incumbent] for x in draws])
            lo, hi = np.percentile(d, [2.5, 97.5])
            rows.append(dict(press=press, regime=regime, q=q[press], incumbent_q=q[incumbent],
                             difference=q[press] - q[incumbent], lo=lo, hi=hi, n=n, refused=bool(hi < 0)))
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--incumbent", required=True)
    p.add_argument("--candidates", nargs="+", required=True)
    p.add_argument("--ruler", nargs="+", required=True)
    p.add_argument("--prose", nargs="+", required=True)
    p.add_argument("--recall", nargs="+", required=True)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75, 0.9])
    p.add_argument("--drop", nargs="*", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.only = None
    table = differences(pool(args), args.incumbent, args.candidates, tuple(args.ratios))
    text = (f"# No regression against `{args.incumbent}` (the rule of 2026-12-06, step 5), development split\n\n"
            f"Command: `python -m experiments.no_regression {' '.join(argv or __import__('sys').argv[1:])}`\n\n"
            "q averaged over r = " + ", ".join(f"{r:g}" for r in args.ratios) + "; difference = q - the incumbent's, "
            f"paired percentile-bootstrap 95 % interval ({DRAWS} draws of the examples, seed 0); refused: the "
            "interval wholly below 0.\n\n" + markdown_table(table.round(3).set_index("press")) + "\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return out


if __name__ == "__main__":
    main()
