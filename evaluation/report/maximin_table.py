"""The maximin rule (``evaluation.report.maximin``) over three regimes' records, written as a table.

    python -m evaluation.report.maximin_table dev  --ruler D... --prose D... --recall D... [--ratios 0.5 0.75]
    python -m evaluation.report.maximin_table test --ruler D... --prose D... --recall D... --ratios 0.25 0.5 0.75
    (--only P... / --drop P...: the pool restricted to / without these presses; --fast: round 3's
    RECOMMENDED_FAST and merge, from the --price record; --out FILE: the output file, default
    results/rule/<split>-maximin.md)

writes the Markdown table and a CSV beside it: every press run in all three regimes, its q per regime and
ratio, worst, mean, bytes held over kvpress top-k's, the picks, and the paired intervals per regime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from evaluation.report import price
from evaluation.report.maximin import intervals, maximin, picks
from evaluation.report.tables import markdown_table
from kvpress_prob.names.registry import is_sampling


def frame(dirs):
    """The records of ``dirs``; a (press, ratio, example, seed) run in more than one keeps its last directory's."""
    df = pd.concat([pd.read_json(Path(d) / "results.jsonl", lines=True) for d in dirs], ignore_index=True)
    return df.drop_duplicates(["press", "compression_ratio", "example_id", "seed"], keep="last")


def bytes_frames(files, only=None) -> dict[str, pd.DataFrame]:
    """regime -> the bytes records of ``files`` for it (every dtype), restricted to ``only`` (and top-k's)."""
    frames = {}
    for f in map(Path, files):
        df = pd.read_json(f, lines=True)
        if only:
            df = df[df["press"].isin([*only, "snapkv", "tova", "keydiff"])]
        for regime, d in df.groupby("dataset"):
            frames[regime] = pd.concat([frames[regime], d]) if regime in frames else d
    return frames


def interval_tables(frames, table, ratios) -> list[str]:
    """Markdown lines: per regime, each candidate's q at each ratio against that regime's best press there,
    with its paired 95 % bootstrap interval over the examples (``evaluation.report.maximin.intervals``)."""
    found = intervals(frames, table, tuple(ratios))
    lines = ["## Paired intervals per regime", "",
             "q of each candidate against the regime's best press of the pool at that ratio (named in the header), "
             "with its paired 95 % percentile-bootstrap interval over the examples every press of the regime ran "
             "(seeds averaged within an example first); n examples.", ""]
    for regime, rows in found.groupby("regime", sort=False):
        header = {r: f"r = {r:g} (best: `{g['best'].iloc[0]}`, n = {g['n'].iloc[0]})" for r, g in rows.groupby("ratio")}
        wide = rows.assign(cell=[f"{q:.3f} [{lo:.3f}, {hi:.3f}]" for q, lo, hi in zip(rows.q, rows.lo, rows.hi)])
        wide = wide.pivot(index="press", columns="ratio", values="cell").reindex(rows["press"].unique())
        wide.columns = [header[r] for r in wide.columns]
        lines += [f"### {regime}", "", markdown_table(wide), ""]
    return lines


def parser() -> argparse.ArgumentParser:
    """The table's command line (``main``'s; ``evaluation.report.recommended`` reads a committed table's back)."""
    p = argparse.ArgumentParser(prog="python -m evaluation.report.maximin_table", description=__doc__.split("\n")[0])
    p.add_argument("split")
    for regime in ("ruler", "prose", "recall"):
        p.add_argument(f"--{regime}", nargs="+", required=True)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75])
    p.add_argument("--only", nargs="+", default=None, help="restrict the pool to these presses")
    p.add_argument("--drop", nargs="+", default=None, help="leave these presses out of the pool (e.g. screened only)")
    p.add_argument("--bytes", nargs="+", default=None,
                   help="bytes records (python -m evaluation.bench bytes: <dataset>-<dtype>.jsonl files): the bytes "
                        "held in each regime they cover, every dtype (else the records' own kv_bytes and bias_bytes)")
    p.add_argument("--fast", action="store_true",
                   help="round 3 of the rule: also pick RECOMMENDED_FAST among the candidates whose prefill in the "
                        "price record is at most 1.2 x snapkv's, RECOMMENDED when within 0.03 of its worst")
    p.add_argument("--out", default=None, help="output file (default: results/rule/<split>-maximin.md)")
    p.add_argument("--decode", action="store_true",
                   help="the rule of 2026-12-05: a candidate also needs a decode step at most 1.10 x snapkv's, and "
                        "with --fast a prefill time and peak at most 1.2 x, each the largest over the --price "
                        "records' rows of at least 3 rounds (a press without one is no candidate)")
    p.add_argument("--price", nargs="+", default=[str(price.RECORD.relative_to(price.ROOT))],
                   help="price records (python -m evaluation.bench price; default %(default)s, read from the "
                        "repository root; a press in several takes the first's row); '—' where none prices a press")
    return p


def pool(args: argparse.Namespace) -> dict[str, pd.DataFrame]:
    """regime -> the records the table's ``args`` name, restricted by ``--only`` / ``--drop``."""
    frames = {r: frame(getattr(args, r)) for r in ("ruler", "prose", "recall")}
    if args.only:
        frames = {r: f[f["press"].isin([*args.only, "full"])] for r, f in frames.items()}
    if args.drop:
        frames = {r: f[~f["press"].isin(args.drop)] for r, f in frames.items()}
    return frames


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    frames = pool(args)
    memory = bytes_frames(args.bytes or [], args.only)
    table = maximin(frames, tuple(args.ratios), memory)
    record_path = [price.ROOT / p for p in args.price]
    record = price.combine([price.maybe_load(p) for p in record_path])
    if args.fast and record is None:
        raise SystemExit(f"--fast needs a price record: {args.price} are missing (python -m evaluation.bench price)")
    if args.decode:
        bound = price.highest([price.maybe_load(p) for p in record_path])
        table["decode_bound"] = bound["decode_over_snapkv"].reindex(table.index)
        chosen = picks(table, prefill=bound["prefill_over_snapkv"] if args.fast else None,
                       peak=bound["peak_over_snapkv"] if args.fast else None, decode=bound["decode_over_snapkv"])
    else:
        chosen = picks(table, prefill=record["prefill_over_snapkv"] if args.fast else None)
    table["samples"] = [is_sampling(press) for press in table.index]
    examples = {r: f.loc[f["press"] != "full", "example_id"].nunique() for r, f in frames.items()}
    shown = table.drop(columns=[c for c in table.columns if c.count("_") == 2 and c.startswith("q_")])
    shown = shown.join(price.columns(shown.index, record))
    lines = [f"# The maximin rule of docs/research/recommendation-rule.md, {args.split} split", "",
             "Command: `python -m evaluation.report.maximin_table " + " ".join(argv) + "`", "",
             f"Examples (before keeping those every press ran): RULER {examples['ruler']}, prose {examples['prose']} "
             f"windows, recall {examples['recall']} windows; ratios {args.ratios}. q = 1 is the regime's best press "
             "of the pool at that ratio (RULER: score / best score; prose, recall: best KL / KL), averaged over the "
             "ratios. held_vs_topk: the largest, over ratios, regimes and dtypes, of bytes held on the cache (keys, "
             "values, bias) over snapkv's"
             + (f", measured by the bytes bench ({', '.join(sorted(memory))}: {', '.join(args.bytes)})" if memory else "")
             + "; candidate: at most 1.01"
             + (" and (the rule of 2026-12-05) decode_bound, the largest decode step over snapkv's in the price "
                "records of at least 3 rounds, at most 1.10" if args.decode else "") + ".", "",
             *[f"- **{k}** = `{v}`: worst {table.loc[v, 'worst']:.3f} ({table.loc[v, 'worst_regime']}), q RULER "
               f"{table.loc[v, 'q_ruler']:.3f}, prose {table.loc[v, 'q_prose']:.3f}, recall {table.loc[v, 'q_recall']:.3f}"
               for k, v in chosen.items()], "",
             f"First by worst among all candidates (any origin): `{table[table.candidate].index[0]}`.", "",
             markdown_table(shown, float_format="{:.3f}"), "", price.note(record, shown.index, record_path if len(record_path) > 1 else record_path[0]), "",
             *interval_tables(frames, table, args.ratios)]
    out = Path(args.out) if args.out else Path("results/rule") / f"{args.split}-maximin.md"
    out.write_text("\n".join(lines))
    table.to_csv(out.with_suffix(".csv"))
    print("\n".join(lines[:14]))
    return out


if __name__ == "__main__":
    main()
