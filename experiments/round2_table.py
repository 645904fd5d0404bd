"""The three-regime table of round 2's enlarged test split: per press and ratio, RULER's mean score, prose KL
over h2o's, recall token accuracy, on the examples every listed press ran (seeds averaged first), with the maximin
table's worst q and each press's price over snapkv's (``evaluation.report.price``: prefill time, prefill peak,
decode step, decode route; "—" without a price record). The record folders are those of the ``k``-th maximin command (from 0) of a maximin script.

    python -m experiments.round2_table [SCRIPT CSV [K]]   # prints a markdown table and the example counts
    (default: results/archive/rule/run-test-maximin-round2.sh results/archive/rule/test-maximin-round2.csv 0)
"""

import re
import sys
from pathlib import Path

import pandas as pd

from evaluation.report import price
from evaluation.report.maximin import complete
from evaluation.report.maximin_table import frame

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["results/archive/rule/run-test-maximin-round2.sh", "results/archive/rule/test-maximin-round2.csv"]
RATIOS = (0.5, 0.75)


def dirs(script: str, k: int, regime: str) -> list[str]:
    """The record folders of ``regime`` in the ``k``-th maximin command of ``script``."""
    run = (ROOT / script).read_text().split("maximin_table")[1 + k]
    words = expand(script, run.split(f"--{regime}", 1)[1].replace("\\\n", " ")).split()
    return [str(ROOT / w) for w in words[: next(i for i, w in enumerate(words) if w.startswith("--"))]]


def expand(script: str, text: str) -> str:
    """``text`` with ``script``'s shell variables (``NAME="..."``) written out."""
    for name, value in re.findall(r'^([A-Z]+)="([^"]*)"', (ROOT / script).read_text(), flags=re.M):
        text = text.replace(f"${name}", " ".join(value.split()))
    return text + " --end"


def means(folders: list[str], value: str, presses: list[str]) -> pd.DataFrame:
    df = frame(folders)
    df = df[df["press"].isin(presses) & df["compression_ratio"].round(6).isin(RATIOS)]
    df = complete(df)
    per = df.groupby(["press", "compression_ratio", "example_id"])[value].mean()
    return per.groupby(["press", "compression_ratio"]).mean().unstack(), df["example_id"].nunique()


def main():
    args = sys.argv[1:] or DEFAULT
    script, k = args[0], int(args[2]) if len(args) > 2 else 0
    q = pd.read_csv(ROOT / args[1], index_col="press")
    presses = list(q.index)
    ruler, n_r = means(dirs(script, k, "ruler"), "score", presses)
    prose, n_p = means(dirs(script, k, "prose"), "kl", presses + ["h2o"])
    recall, n_c = means(dirs(script, k, "recall"), "acc", presses)
    prose = prose / prose.loc["h2o"]
    record = price.maybe_load()
    costs = price.columns(presses, record, spread=False)
    print(f"RULER {n_r} examples, prose {n_p} windows, recall {n_c} windows\n")
    print("| press | RULER | prose KL / h2o's | recall accuracy % | worst q | candidate | "
          + " | ".join(costs.columns) + " |\n|---|---|---|---|---|---|" + "---|" * len(costs.columns))
    for p in presses:
        cell = lambda t, f: " / ".join(f.format(t.loc[p, r]) if p in t.index else "–" for r in RATIOS)
        print(f"| `{p}` | {cell(ruler, '{:.1f}')} | {cell(prose, '{:.2f}')} | {cell(recall, '{:.1f}')} | "
              f"{q.loc[p, 'worst']:.3f} | {q.loc[p, 'candidate']} | " + " | ".join(costs.loc[p]) + " |")
    print("\n" + price.note(record, presses))


if __name__ == "__main__":
    main()
