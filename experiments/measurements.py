"""The pictures of docs/measurements.md, each drawn from committed records under results/ (no model is run).

    python -m experiments.measurements price    # quality against prefill price: the test table and its price records
    python -m experiments.measurements budget   # KVzip's global kept set across layers and KV heads
    python -m experiments.measurements draws    # attention error against the number of draws
    python -m experiments.measurements decode   # decode throughput over snapkv's: the price records
    python -m experiments.measurements          # all four

Each writes ``docs/measurements/<name>.png`` (``--out`` another folder) and prints its path.

- ``price``: every press of the test-split maximin table (``TABLE``'s CSV): its worst q over RULER, prose and
  recall against its prefill time over snapkv's, read from the price records the table's own command names (a
  press in several takes the first's row, as in the table), the bar the range over rounds. The staircase joins
  the presses no other press beats on both (lower or equal time, higher worst q); the recommendations are named
  in bold.
- ``budget``: the kept count of each (layer, KV head) of KVzip's global top set (the kept set of
  ``topk_kvzip_global``, stored ragged), over the mean count per head, averaged over the RULER development
  examples of ``BUDGET`` (``experiments.zip_gap --part survival``), one panel per ratio.
- ``draws``: the fidelity bench's temperature sweep (``FIDELITY``): the relative error of the attention outputs
  (||o_S - o|| / ||o|| per layer, averaged over layers and seeds) against m, the Poisson scale of the draws (the
  expected number of draws, which the budget sets), one point per example, press, temperature and ratio.
- ``decode``: one decoding step's time over snapkv's, inverted (tokens per second over snapkv's), for every press
  of ``DECODE_RECORDS`` at r = 0.5 and 0.9: the median over rounds, the bar its range.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "measurements"
TABLE = ROOT / "results" / "rule" / "test-maximin-round4.md"
BUDGET = ROOT / "results" / "archive" / "dev" / "zip-diagnose" / "survival.jsonl"
FIDELITY = ROOT / "results" / "archive" / "bench" / "fidelity"
DECODE_RECORDS = ["results/bench/price-round4/r0.5/price.jsonl", "results/bench/price-round4/r0.9/price.jsonl",
                  "results/bench/price-ragged/r0.5/price.jsonl", "results/bench/price-ragged/r0.9/price.jsonl"]


def _figure(width: float = 8, height: float = 6):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _save(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    if not fig.get_constrained_layout():
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _table_price_records(table: Path) -> list[str]:
    """The ``--price`` records of ``table``'s own command (its line 3)."""
    from evaluation.report.maximin_table import parser

    command = table.read_text().splitlines()[2].removeprefix("Command: `").removesuffix("`")
    words = shlex.split(command)
    return parser().parse_args(words[words.index("evaluation.report.maximin_table") + 1:]).price


def frontier(points: pd.DataFrame, x: str = "price", y: str = "worst") -> list[str]:
    """The presses no other press beats on both: none has ``x`` <= and ``y`` > (ties on ``x``: the higher ``y``),
    in order of ``x``."""
    best, out = -np.inf, []
    for press, row in points.sort_values([x, y], ascending=[True, False]).iterrows():
        if row[y] > best:
            out.append(press)
            best = row[y]
    return out


def price(out: Path = OUT) -> Path:
    from evaluation.report import price as prices
    from kvpress_prob.names import registry

    table = pd.read_csv(TABLE.with_suffix(".csv"), index_col="press")
    records = _table_price_records(TABLE)
    record = prices.combine([prices.load(ROOT / p) for p in records])
    priced = table.join(record[["prefill_over_snapkv", "prefill_over_snapkv_lo", "prefill_over_snapkv_hi"]],
                        how="inner").rename(columns={"prefill_over_snapkv": "price"})
    from evaluation.report.recommended import LABELS

    picks: dict[str, list[str]] = {}
    for constant, label in LABELS.items():  # a press may hold several roles
        picks.setdefault(getattr(registry, constant), []).append(label)
    fig = _figure()
    ax = fig.add_subplot()
    x = priced["price"]
    ax.errorbar(x, priced["worst"], xerr=[x - priced["prefill_over_snapkv_lo"], priced["prefill_over_snapkv_hi"] - x],
                fmt="none", ecolor="grey", lw=0.8)
    ax.scatter(x, priced["worst"], s=36, c=["tab:blue" if c else "tab:grey" for c in priced["candidate"]], zorder=3)
    edge = priced.loc[frontier(priced)]
    ax.step(edge["price"], edge["worst"], where="post", color="tab:green", lw=1.2, zorder=2,
            label="frontier: no press is cheaper and better")
    for press, row in priced.iterrows():
        label = f"{press} ({', '.join(picks[press])})" if press in picks else press
        left = row["price"] > x.max() / 1.6  # near the right edge: the label goes to the left of its point
        ax.annotate(label, (row["price"], row["worst"]), fontsize=6.5, xytext=(-4 if left else 4, 3),
                    textcoords="offset points", ha="right" if left else "left",
                    fontweight="bold" if press in picks else "normal")
    ax.set_xscale("log")
    ticks = [t for t in (0.8, 1, 1.5, 2, 3, 4, 5, 6, 8) if x.min() / 1.3 <= t <= x.max() * 1.3]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("prefill time over snapkv's (4096 tokens, one CPU thread; median [range] over rounds)")
    ax.set_ylabel("worst q over RULER, prose and recall (1 = the regime's best press)")
    ax.set_title("Quality against prefill price, test split (blue: at top-k's memory; bold: a recommendation)")
    ax.legend(loc="lower right", fontsize=7)
    lacking = sorted(set(table.index) - set(priced.index))
    if lacking:
        fig.text(0.01, 0.005, "not priced: " + ", ".join(lacking), fontsize=6)
    return _save(fig, out / "quality-price.png")


def budget(out: Path = OUT) -> Path:
    rows = [json.loads(line) for line in BUDGET.read_text().splitlines() if line.strip()]
    ruler = [r for r in rows if r["benchmark"] == "ruler"]
    ratios = sorted({r["ratio"] for r in ruler})
    fig = _figure(9, 5.5)
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, len(ratios), sharey=True)
    shares, examples = {}, {}
    for ratio in ratios:
        counts = np.array([np.array(r["kvzip_counts"], dtype=float) for r in ruler if r["ratio"] == ratio])
        shares[ratio] = (counts / counts.mean(axis=(1, 2), keepdims=True)).mean(axis=0)  # (layers, heads)
        examples[ratio] = len(counts)
    top = float(np.ceil(max(share.max() for share in shares.values())))  # one colour scale for every panel
    for ax, ratio in zip(np.atleast_1d(axes), ratios):
        share = shares[ratio]
        image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=top)
        ax.set_title(f"r = {ratio:g} ({examples[ratio]} RULER dev examples)", fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(share.shape[1]))
        for layer, head in np.ndindex(share.shape):
            ax.text(head, layer, f"{share[layer, head]:.1f}", ha="center", va="center", fontsize=5, color="white")
    np.atleast_1d(axes)[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="kept entries over the mean per head")
    fig.suptitle("KVzip's global top set (topk_kvzip_global's, stored ragged): the budget across layers and heads",
                 fontsize=10)
    return _save(fig, out / "kept-budget.png")


def draws(out: Path = OUT) -> Path:
    from evaluation.bench.fidelity.tables import load_records

    markers = {"prob_snapkv": "o", "prob_min_h": "^"}
    df = load_records(FIDELITY)
    df["base"] = df["press"].str.split("[").str[0]
    df = df[df["m"].notna() & df["base"].isin(list(markers)) & (df["budget"] == "global")].copy()
    df["error"] = [float(np.mean(runs)) for runs in df["layer_err"]]
    fig = _figure()
    ax = fig.add_subplot()
    colours = dict(zip(sorted(df["compression_ratio"].unique()), ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for (base, ratio), part in df.groupby(["base", "compression_ratio"]):
        ax.scatter(part["m"], part["error"], s=14, marker=markers.get(base, "s"), color=colours[ratio], alpha=0.7,
                   label=f"{base}, r = {ratio:g}")
    ax.set_xscale("log")
    ax.set_xlabel("m: the Poisson scale of the draws (the expected number of draws), set by the budget; "
                  "each point one example at one temperature (1, 2, 4, inf)", fontsize=8)
    ax.set_ylabel("attention error ||o_S - o|| / ||o||, mean over layers and 3 seeds")
    examples = df["example_id"].nunique()
    ax.set_title(f"Attention error against the number of draws ({examples} NIAH examples at 2048 tokens)")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / "error-draws.png")


def decode(out: Path = OUT) -> Path:
    from evaluation.report import price as prices

    rows = pd.concat([prices.load(ROOT / p).reset_index() for p in DECODE_RECORDS])
    rows = rows[rows["press"] != "snapkv"]
    rows["speed"] = 1 / rows["decode_over_snapkv"]
    rows["lo"], rows["hi"] = 1 / rows["decode_over_snapkv_hi"], 1 / rows["decode_over_snapkv_lo"]
    presses = sorted(rows["press"].unique())
    fig = _figure(8, 5)
    ax = fig.add_subplot()
    width = 0.38
    for i, (ratio, colour) in enumerate(((0.5, "tab:blue"), (0.9, "tab:orange"))):
        part = rows[rows["ratio"] == ratio].drop_duplicates("press").set_index("press").reindex(presses)
        at = np.arange(len(presses)) + (i - 0.5) * width
        ax.bar(at, part["speed"], width, color=colour, label=f"r = {ratio:g}")
        ax.errorbar(at, part["speed"], yerr=[part["speed"] - part["lo"], part["hi"] - part["speed"]], fmt="none",
                    ecolor="black", lw=0.8)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.axhline(1 / 1.10, color="tab:red", lw=0.8, ls=":", label="1 / 1.10: the decode-step bound")
    ax.set_xticks(range(len(presses)), presses, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("decode tokens/s over snapkv's\n(median [range] over rounds)")
    n = int(rows["n"].iloc[0])
    ax.set_title(f"Decode throughput on the kept cache, {n} tokens, one CPU thread")
    ax.legend(fontsize=7)
    return _save(fig, out / "decode.png")


PICTURES = {"price": price, "budget": budget, "draws": draws, "decode": decode}


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(prog="python -m experiments.measurements", description=__doc__.split("\n\n")[0])
    p.add_argument("pictures", nargs="*", help=f"any of {', '.join(PICTURES)} (default: all four)")
    p.add_argument("--out", type=Path, default=OUT, help="output folder (default docs/measurements)")
    args = p.parse_args(argv)
    unknown = [name for name in args.pictures if name not in PICTURES]
    if unknown:
        p.error(f"unknown picture(s) {unknown}; valid: {', '.join(PICTURES)}")
    written = [PICTURES[name](args.out) for name in (args.pictures or PICTURES)]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
