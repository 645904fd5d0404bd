"""The recommendations, with their quality, price and evidence, read from one source each.

- which presses: the registry's constants (``kvpress_prob.names.registry``: ``RECOMMENDED``,
  ``RECOMMENDED_FAST``, ``RECOMMENDED_PROSE``, ``RECOMMENDED_RETRIEVAL``, ``RECOMMENDED_SLOW``);
- quality: the committed test-split maximin table (``TEST_TABLE``, written by
  ``evaluation.report.maximin_table``): q per regime at each ratio (1 = the regime's best press of the table's
  pool there) and the worst regime's q; the evidence (model, context length, split, example counts, seeds,
  record folders) is read back from the records the table's own command names;
- price: every price record ``results/bench/**/price.jsonl`` at r = ``PRICE_RATIO`` and n = ``PRICE_LENGTH`` (``python -m evaluation.bench price``; read by
  ``evaluation.report.price``): the newest record that prices the press (by the date of the commit that last
  wrote it, else its file's modification time) gives the median, and the range beside it is the smallest and
  largest round of every record that prices it. A press no record prices has no price ("no price record"):
  another press's figures are never shown.

    rows()                  # one Recommendation per constant, in LABELS' order
    markdown(rows())        # the README's "which press to use" table, with its note
    text(rows())            # the same for a terminal (kvprob presses, kvprob recommended)
    replace_block(readme)   # README text with the table between BEGIN and END regenerated

``kvprob recommended [--markdown] [--write FILE]`` prints the table, or rewrites it in ``FILE``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from evaluation.report import price
from evaluation.report.aggregate import REFERENCE
from evaluation.report.maximin import FAST, REGIMES, complete
from evaluation.report.maximin_table import parser as table_parser
from evaluation.report.maximin_table import pool
from evaluation.report.tables import markdown_table
from kvpress_prob.names import registry

ROOT = price.ROOT
#: The test-split table the quality and evidence come from.
TEST_TABLE = ROOT / "results" / "rule" / "test-maximin-round5.md"
#: The price records: every record of the price bench (a folder may hold one record per ratio).
PRICE_RECORDS = "results/bench/**/price.jsonl"
#: The ratio the table's price is read at: every priced press has a record there, so the rows compare.
PRICE_RATIO = 0.5
#: The context length the table's price is read at (a record at another length prices another question).
PRICE_LENGTH = 4096
#: constant of ``kvpress_prob.names.registry`` -> its label.
LABELS = {"RECOMMENDED": "default", "RECOMMENDED_FAST": "fast", "RECOMMENDED_PROSE": "prose",
          "RECOMMENDED_RETRIEVAL": "retrieval", "RECOMMENDED_SLOW": "slow"}
#: constant -> what it is for, in one line.
PURPOSE = {
    "RECOMMENDED": "the best worst case over retrieval, prose and recall on the development splits, at kvpress "
                   "top-k's memory",
    "RECOMMENDED_FAST": f"the same choice among presses prefilling within {FAST:g} x snapkv's time; the embedded "
                        "model's gate ships, another model's is trained by kvprob train-gate",
    "RECOMMENDED_PROSE": "the best on prose (next-token KL to the full cache) on the development splits, at kvpress "
                         "top-k's memory",
    "RECOMMENDED_RETRIEVAL": "the best on RULER retrieval on the development splits, at kvpress top-k's memory",
    "RECOMMENDED_SLOW": "the exact press the merge replaced; it needs no trained gate or profile, for a model "
                        "kvprob train-gate has not trained",
}
NO_PRICE = "no price record"
NO_QUALITY = "no test record"
BEGIN, END = "<!-- recommended table: begin (kvprob recommended --write README.md) -->", "<!-- recommended table: end -->"
FIGURES = tuple(price.COLUMNS)  # prefill, peak, decode


@dataclasses.dataclass(frozen=True)
class Price:
    """A press's price over snapkv's: per figure of ``evaluation.report.price.COLUMNS``, the newest record's
    median and the (smallest, largest) round over every record (``spread``)."""

    median: dict[str, float]
    spread: dict[str, tuple[float, float]]
    record: str  # the newest record's path, from the repository root
    records: tuple[str, ...]  # every record that prices the press, newest first
    device: str
    n: int
    ratio: float
    rounds: int
    decode_route: str
    command: str

    def cell(self, figure: str) -> str:
        lo, hi = self.spread[figure]
        return f"{self.median[figure]:.2f} [{lo:.2f}, {hi:.2f}]"


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Where a press's quality comes from."""

    model: str
    context: str  # tokens of context (the records' data_dir)
    split: str
    ratios: tuple[float, ...]
    examples: dict[str, int]  # regime -> examples every press of the regime ran (those the q's average)
    seeds: int  # seeds of the press per example (the largest over regimes)
    table: str  # the table's path, from the repository root
    folders: tuple[str, ...]  # the record folders holding the press's rows


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """One recommendation: the constant, its label and press, what it is for, quality, price and evidence."""

    constant: str
    label: str
    press: str
    purpose: str
    quality: dict[str, dict[float, float]] | None  # regime -> ratio -> q; None: the test table lacks the press
    regime_q: dict[str, float] | None  # regime -> q averaged over the ratios
    worst: float | None
    worst_regime: str | None
    price: Price | None
    evidence: Evidence | None


def _relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def written(path: Path) -> datetime:
    """When ``path`` was written: the date of the last commit that changed it, or, where it has none or has
    changed since (an uncommitted record), its modification time."""
    mtime = datetime.fromtimestamp(Path(path).stat().st_mtime, timezone.utc)
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a, "--", str(path)], capture_output=True,
                                        text=True, timeout=30).stdout.strip()
        if run("status", "--porcelain"):
            return mtime
        date = run("log", "-1", "--format=%cI")
    except (OSError, subprocess.SubprocessError):
        return mtime
    return datetime.fromisoformat(date) if date else mtime


@functools.cache
def price_records(pattern: str = PRICE_RECORDS) -> tuple[tuple[str, pd.DataFrame], ...]:
    """(path, record) for every price record matching ``pattern`` under the repository root, newest first."""
    paths = sorted(ROOT.glob(pattern), key=lambda p: (written(p), str(p)), reverse=True)
    return tuple((_relative(p), price.load(p)) for p in paths)


def price_of(press: str, records=None) -> Price | None:
    """``press``'s price at ``PRICE_RATIO`` and ``PRICE_LENGTH`` tokens from ``records`` (``price_records()``'s, newest first), or None where
    none prices it there."""
    found = [(path, r.loc[press]) for path, r in (price_records() if records is None else records)
             if press in r.index and float(r.loc[press, "ratio"]) == PRICE_RATIO
             and int(r.loc[press, "n"]) == PRICE_LENGTH]
    if not found:
        return None
    path, row = found[0]
    rows = [r for _, r in found]
    return Price(median={f: float(row[f"{f}_over_snapkv"]) for f in FIGURES},
                 spread={f: (min(float(r[f"{f}_over_snapkv_lo"]) for r in rows),
                             max(float(r[f"{f}_over_snapkv_hi"]) for r in rows)) for f in FIGURES},
                 record=path, records=tuple(p for p, _ in found), device=str(row["device"]), n=int(row["n"]),
                 ratio=float(row["ratio"]), rounds=int(row["rounds"]), decode_route=str(row["decode_route"]),
                 command=str(row["command"]))


def table_command(table: Path = TEST_TABLE) -> list[str]:
    """The arguments of the ``maximin_table`` command that wrote ``table`` (its "Command:" line)."""
    match = re.search(r"^Command: `python -m evaluation\.report\.maximin_table (.+)`$", Path(table).read_text(), re.M)
    if match is None:
        raise ValueError(f"{table}: no 'Command: `python -m evaluation.report.maximin_table ...`' line")
    return shlex.split(match.group(1))


@functools.cache
def _table(table: Path = TEST_TABLE):
    args = table_parser().parse_args(table_command(table))
    for regime in REGIMES:
        setattr(args, regime, [str(ROOT / d) for d in getattr(args, regime)])
    ratios = tuple(args.ratios)
    frames = {r: f[f["compression_ratio"].round(6).isin(ratios) & (f["press"] != REFERENCE)]
              for r, f in pool(args).items()}
    return args, frames, pd.read_csv(Path(table).with_suffix(".csv"), index_col="press")


@functools.cache
def evidence(press: str, table: Path = TEST_TABLE) -> Evidence | None:
    """The records behind ``press``'s row of ``table``, or None where the table lacks the press."""
    args, frames, csv = _table(table)
    if press not in csv.index:
        return None
    rows = pd.concat([f[f["press"] == press] for f in frames.values()])
    folders = [d for r in REGIMES for d in getattr(args, r)
               if (pd.read_json(Path(d) / "results.jsonl", lines=True)["press"] == press).any()]
    return Evidence(model=", ".join(sorted(rows["model"].unique())),
                    context=", ".join(sorted(rows["data_dir"].astype(str).unique())), split=args.split,
                    ratios=tuple(args.ratios), examples={r: complete(f)["example_id"].nunique() for r, f in frames.items()},
                    seeds=int(rows.groupby(["dataset", "example_id", "compression_ratio"])["seed"].nunique().max()),
                    table=_relative(table), folders=tuple(_relative(d) for d in folders))


def recommendation(constant: str, table: Path = TEST_TABLE, records=None) -> Recommendation:
    """The row of the registry's ``constant`` (a key of ``LABELS``)."""
    press = getattr(registry, constant)
    csv = _table(table)[2]
    row = csv.loc[press] if press in csv.index else None
    ratios = _table(table)[0].ratios
    return Recommendation(
        constant=constant, label=LABELS[constant], press=press, purpose=PURPOSE[constant],
        quality=None if row is None else {g: {r: float(row[f"q_{g}_{r:g}"]) for r in ratios} for g in REGIMES},
        regime_q=None if row is None else {g: float(row[f"q_{g}"]) for g in REGIMES},
        worst=None if row is None else float(row["worst"]), worst_regime=None if row is None else row["worst_regime"],
        price=price_of(press, records), evidence=evidence(press, table))


def rows(table: Path = TEST_TABLE, records=None) -> list[Recommendation]:
    """One ``Recommendation`` per constant of ``LABELS``, in its order."""
    return [recommendation(constant, table, records) for constant in LABELS]


_NAMES = {"ruler": "RULER", "prose": "prose", "recall": "recall"}


def quality_cell(rec: Recommendation) -> str:
    if rec.worst is None:
        return NO_QUALITY
    return f"{rec.worst:.3f} ({_NAMES[rec.worst_regime]})"


def regimes_cell(rec: Recommendation) -> str:
    return NO_QUALITY if rec.regime_q is None else " / ".join(f"{rec.regime_q[g]:.3f}" for g in REGIMES)


def evidence_cell(rec: Recommendation) -> str:
    e = rec.evidence
    if e is None:
        return NO_QUALITY
    return (f"{e.model}, {e.context} tokens, {e.split} split, n = "
            + " / ".join(str(e.examples[g]) for g in REGIMES) + f", {e.seeds} seed{'s' * (e.seeds > 1)}")


def frame(recs: list[Recommendation]) -> pd.DataFrame:
    """The table: one row per distinct press, naming every role it holds (its constants, in ``LABELS``' order)."""
    presses = list(dict.fromkeys(rec.press for rec in recs))
    out = {}
    for press in presses:
        held = [rec for rec in recs if rec.press == press]
        rec = held[0]
        roles = ", ".join(r.label for r in held) + " (" + ", ".join(f"`{r.constant}`" for r in held) + ")"
        out[roles] = {
            "press": f"`{rec.press}`", "for": "; ".join(r.purpose for r in held), "worst q": quality_cell(rec),
            "q " + " / ".join(_NAMES[g] for g in REGIMES): regimes_cell(rec),
            **{price.COLUMNS[f]: NO_PRICE if rec.price is None else rec.price.cell(f) for f in FIGURES},
            "evidence": evidence_cell(rec)}
    df = pd.DataFrame.from_dict(out, orient="index")
    df.index.name = "use"
    return df


def note(recs: list[Recommendation]) -> str:
    """The sentence under the table: what q and the price figures are, and their records."""
    tables = sorted({r.evidence.table for r in recs if r.evidence})
    ratios = sorted({x for r in recs if r.evidence for x in r.evidence.ratios})
    settings = sorted({f"{r.price.device}, n = {r.price.n} tokens, r = {r.price.ratio:g}" for r in recs if r.price})
    records = sorted({p for r in recs if r.price for p in r.price.records})
    return (f"q: quality over the regime's best press of the table's pool (1 = as good), averaged over r = "
            f"{', '.join(f'{r:g}' for r in ratios)}; worst q: the lowest regime's; n = examples in RULER / prose / "
            f"recall ({', '.join(tables)}). Price over snapkv's ({'; '.join(settings)}): the newest record's "
            f"median [the smallest and largest round over every record that prices the press]; records: "
            f"{', '.join(records)}.")


def markdown(recs: list[Recommendation] | None = None) -> str:
    """The README's "which press to use" table and its note."""
    recs = rows() if recs is None else recs
    return markdown_table(frame(recs)).rstrip("\n") + "\n\n" + note(recs)


def text(recs: list[Recommendation] | None = None) -> list[str]:
    """Terminal lines: per recommendation, its press, purpose, quality at each ratio, price and evidence."""
    lines = []
    for rec in rows() if recs is None else recs:
        lines += [f"{rec.label:<10} {rec.constant} = {rec.press}", f"    for:      {rec.purpose}"]
        if rec.quality is None:
            lines.append(f"    quality:  {NO_QUALITY} in {_relative(TEST_TABLE)}")
        else:
            per = "; ".join(f"{_NAMES[g]} " + ", ".join(f"{q:.3f}" for q in rec.quality[g].values()) for g in REGIMES)
            ratios = ", ".join(f"{r:g}" for r in rec.evidence.ratios)
            lines.append(f"    quality:  worst q {quality_cell(rec)}; q at r = {ratios}: {per}")
            lines.append(f"    evidence: {evidence_cell(rec)}; {rec.evidence.table}; records "
                         + ", ".join(rec.evidence.folders))
        lines.append(f"    price:    {price_line(rec.press, rec.price)}")
    return lines


def price_line(press: str, found: Price | None) -> str:
    """One line: ``press``'s price ``found`` (``price_of``), or ``price.MISSING`` and the command that measures it."""
    if found is None:
        return f"{price.MISSING} ({NO_PRICE} for {press}: python -m evaluation.bench price --presses snapkv {press})"
    p = found
    figures = ", ".join(f"{name.split(' /')[0]} {p.cell(f)}" for f, name in price.COLUMNS.items())
    return (f"over snapkv's, newest median [range over {len(p.records)} record{'s' * (len(p.records) > 1)}]: "
            f"{figures}; decoded by {p.decode_route}; newest: {p.record} ({p.device}, n = {p.n}, r = {p.ratio:g}, "
            f"{p.rounds} rounds): {p.command}")


def replace_block(readme: str, recs: list[Recommendation] | None = None) -> str:
    """``readme`` with the text between ``BEGIN`` and ``END`` replaced by ``markdown(recs)``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no recommended table between {BEGIN!r} and {END!r}")
    return readme[:start + len(BEGIN)] + "\n" + markdown(recs) + "\n" + readme[end:]


def block(readme: str) -> str | None:
    """The text between ``BEGIN`` and ``END`` in ``readme`` (stripped), or None where they are absent."""
    start, end = readme.find(BEGIN), readme.find(END)
    return None if start < 0 or end < start else readme[start + len(BEGIN):end].strip()
