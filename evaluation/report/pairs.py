"""Press pairs compared on the same examples: score and bytes held (``python -m evaluation.report.pairs``).

For each pair A:B and compression ratio: the mean score of each arm, A minus B paired over the examples
both completed (seeds averaged within an example; 95 % t-interval, ``evaluation.report.stats``), and the
bytes each arm holds as a fraction of the full cache of the same example. Bytes held are the keys and
values in the cache (``kv_bytes`` of the records) plus, for a SamplingPress, its correction bias:
one value in the keys' dtype per stored entry and KV head, i.e. kv_bytes / (2 * head_dim).

    python -m evaluation.report.pairs --results runs/adaptive runs/adakv \\
        --pairs snapkv_adaptive:adakv_snapkv --split test --out runs/adaptive-vs-adakv.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from evaluation.engine.runner import REFERENCE
from evaluation.report.stats import paired_table
from evaluation.store.results import load_folders, write_atomic
from kvpress_prob import SamplingPress, get_press


def held_bytes(df: pd.DataFrame, head_dim: int) -> pd.Series:
    """Bytes held per record: keys and values, plus the correction bias of a SamplingPress."""
    sampling = {name: isinstance(get_press(name, 0.5), SamplingPress) for name in df["press"].unique()}
    bias = df["kv_bytes"] / (2 * head_dim)
    return df["kv_bytes"] + bias.where(df["press"].map(sampling), 0.0)


def pair_table(df: pd.DataFrame, pairs: list[tuple[str, str]], head_dim: int) -> pd.DataFrame:
    """One row per pair and ratio: n examples, each arm's mean score and held fraction, A - B paired."""
    full = df[df["press"] == REFERENCE].groupby("example_id")["kv_bytes"].first()
    df = df[df["press"] != REFERENCE].copy()
    df["held"] = held_bytes(df, head_dim) / df["example_id"].map(full)
    rows = []
    for a, b in pairs:
        scores = paired_table(df, "score", "press", a, b, by=["compression_ratio"])
        held = paired_table(df, "held", "press", a, b, by=["compression_ratio"])
        for (_, s), (_, h) in zip(scores.iterrows(), held.iterrows()):
            rows.append({"A": a, "B": b, "r": s["compression_ratio"], "n": int(s["n"]), "score A": s["mean_a"],
                         "score B": s["mean_b"], "A - B": s["mean"], "lo": s["lo"], "hi": s["hi"],
                         "held A": h["mean_a"], "held B": h["mean_b"]})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame, split: str) -> str:
    lines = [f"Split: {split}. Score: mean over examples; A - B paired over the n examples both completed "
             "(95 % t-interval). Held: bytes held (keys + values, plus the correction bias of a SamplingPress) "
             "as a fraction of the full cache of the same example.\n",
             "| A | B | r | n | score A | score B | A - B [95 % CI] | held A | held B |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, row in table.iterrows():
        lines.append(f"| {row['A']} | {row['B']} | {row['r']:g} | {row['n']} | {row['score A']:.1f} | "
                     f"{row['score B']:.1f} | {row['A - B']:+.1f} [{row['lo']:+.1f}, {row['hi']:+.1f}] | "
                     f"{row['held A']:.3f} | {row['held B']:.3f} |")
    return "\n".join(lines) + "\n"


def parse_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"a pair is A:B (two press names), got {text!r}")
    return a, b


def pair_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the options of a report on press pairs (this module's, ``evaluation.report.twins``'):
    --results, --pairs, --split and --out."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--results", nargs="+", required=True, help="results folders or .jsonl files (one split)")
    parser.add_argument("--pairs", nargs="+", type=parse_pair, required=True, metavar="A:B",
                        help="press pairs (registry names), A minus B")
    parser.add_argument("--split", required=True, choices=["development", "test"], help="which split the results are")
    parser.add_argument("--out", default=None, help="markdown file to write (unset: print only)")
    return parser


def main(argv: list[str] | None = None) -> str:
    parser = pair_parser("python -m evaluation.report.pairs", __doc__.split("\n")[0])
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension of the model (SmolLM2-135M: 64)")
    args = parser.parse_args(argv)
    df = load_folders(args.results)
    df = df.drop_duplicates(["model", "dataset", "data_dir", "example_id", "press", "compression_ratio", "seed"])
    return publish(markdown(pair_table(df, args.pairs, args.head_dim), args.split), args.out)


def publish(text: str, out: str | None) -> str:
    """Print a pair report's markdown and, with ``out``, write it there first; returns it."""
    if out:
        write_atomic(Path(out), text)
    print(text)
    return text


if __name__ == "__main__":
    main()
