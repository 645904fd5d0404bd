"""What each press costs over snapkv, read from a price record, as the tables show it.

A price record (``python -m evaluation.bench price``: ``results/bench/price/price.jsonl``; on a GPU,
``kvprob gpu-check``: ``results/gpu/<device>/price.jsonl``) holds one JSON row per press (and, from the GPU
check, per model and length): the ratios over snapkv's, measured side by side in one run, of

- ``prefill_over_snapkv``: the prefill's wall time (eviction included);
- ``peak_over_snapkv``: the prefill's peak memory above what was held before it;
- ``decode_over_snapkv``: one decoding step's wall time, on the press's cache at its kept length;

each a median over rounds with its range (``_lo``, ``_hi``), and ``decode_route``: the attention function
that decoded (``evaluation.bench.speed.route``), with the record's ``device``, ``n``, ``ratio``, ``rounds`` and
``command`` on every row.

    record = load()                               # press -> row; raises if a press appears twice
    columns(["snapkv", "kvzip"], record)          # the price columns of a table, "—" without a record
    note(record)                                  # the sentence under a table: where the figures come from
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "results" / "bench" / "price" / "price.jsonl"
MISSING = "—"
COLUMNS = {"prefill": "prefill time / snapkv", "peak": "prefill peak / snapkv", "decode": "decode step / snapkv"}
REQUIRED = ["press", "device", "n", "ratio", "rounds", "command", "decode_route",
            *[f"{s}_over_snapkv{end}" for s in COLUMNS for end in ("", "_lo", "_hi")]]


def load(path: str | Path = RECORD, **where) -> pd.DataFrame:
    """The record at ``path`` indexed by press, restricted to the rows whose fields equal ``where``
    (``model="llama-3.2-3b", n=4096`` for a GPU check's record). Raises if a field the tables read is
    missing or a press appears more than once (say which rows with ``where``)."""
    df = pd.read_json(path, lines=True)
    missing = [c for c in REQUIRED if c not in df]
    if missing:
        raise ValueError(f"{path}: a price record needs the fields {missing}")
    for field, value in where.items():
        df = df[df[field] == value]
    twice = sorted(df.press[df.press.duplicated()].unique())
    if twice:
        raise ValueError(f"{path}: {twice} appear more than once; choose the rows with load(path, field=value)")
    return df.set_index("press")


def cell(row: pd.Series, figure: str, spread: bool = True) -> str:
    """``figure``'s ratio over snapkv's: "m [lo, hi]" (``spread``) or "m"."""
    m = row[f"{figure}_over_snapkv"]
    if not spread:
        return f"{m:.2f}"
    return f"{m:.2f} [{row[f'{figure}_over_snapkv_lo']:.2f}, {row[f'{figure}_over_snapkv_hi']:.2f}]"


def columns(presses, record: pd.DataFrame | None, spread: bool = True) -> pd.DataFrame:
    """One row per press of ``presses`` (in their order): the three ratios over snapkv's and the decode route,
    ``MISSING`` for a press the record does not hold (or for every press without a record). Nothing is
    filled in from elsewhere."""
    out = {}
    for press in presses:
        row = None if record is None or press not in record.index else record.loc[press]
        values = {name: MISSING if row is None else cell(row, figure, spread) for figure, name in COLUMNS.items()}
        out[press] = values | {"decode route": MISSING if row is None else str(row["decode_route"])}
    return pd.DataFrame.from_dict(out, orient="index")


def note(record: pd.DataFrame | None, presses=(), path: str | Path | list = RECORD) -> str:
    """Where the price columns come from (``path``: the record's file, or its files), and which of ``presses``
    have no figures (shown as ``MISSING``)."""
    paths = path if isinstance(path, list) else [path]
    shown = ", ".join(str(Path(p).resolve().relative_to(ROOT)) if Path(p).resolve().is_relative_to(ROOT) else str(p)
                      for p in paths)
    if record is None:
        return f"Price columns: {MISSING} everywhere: no price record ({shown}; `python -m evaluation.bench price`)."
    m = record.iloc[0]
    lacking = [p for p in presses if p not in record.index]
    runs = record.groupby("command", sort=False).groups
    where = (f"`{m['command']}`): ratios over snapkv's measured side by side in one run" if len(runs) == 1 else
             "; ".join(f"`{c}` for {', '.join(f'`{p}`' for p in names)}" for c, names in runs.items())
             + "): ratios over snapkv's measured side by side within each run (each run times its own snapkv)")
    text = (f"Price columns (`{shown}`, {where} on "
            f"{m['device']}, n = {m['n']} tokens, r = {m['ratio']:g}: prefill wall time, prefill peak memory above "
            f"what was held before, one decoding step at the press's kept length; median [range] over {m['rounds']} "
            f"rounds; decode route: the attention function a spy saw decode.")
    if lacking:
        text += f" {MISSING}: no price record for {', '.join(f'`{p}`' for p in lacking)}."
    return text


def combine(records: list[pd.DataFrame | None]) -> pd.DataFrame | None:
    """One record from several (each ``load``'s), a press priced by more than one taking the first's row: each
    row keeps its own run's ``command``, which ``note`` names. None when none of ``records`` exists."""
    found = [r for r in records if r is not None]
    if not found:
        return None
    merged = pd.concat(found)
    return merged[~merged.index.duplicated(keep="first")]


def highest(records: list[pd.DataFrame | None], rounds: int = 3) -> pd.DataFrame:
    """press -> the largest of each ``*_over_snapkv`` over every row of ``records`` with at least ``rounds``
    rounds (a press priced at several ratios or in several runs is held to its dearest): the figures a rule's
    price bounds read."""
    found = [r for r in records if r is not None]
    if not found:
        return pd.DataFrame(columns=[f"{s}_over_snapkv" for s in COLUMNS])
    merged = pd.concat(found)
    merged = merged[merged["rounds"] >= rounds]
    return merged[[f"{s}_over_snapkv" for s in COLUMNS]].groupby(level=0).max()


def maybe_load(path: str | Path = RECORD, **where) -> pd.DataFrame | None:
    """``load(path, **where)``, or None where there is no record at ``path``."""
    return load(path, **where) if Path(path).exists() else None


def table_presses(folder: str | Path = ROOT / "results" / "rule") -> list[str]:
    """Every press of the committed maximin tables (``*maximin*.csv`` under ``folder``), in first-seen order."""
    names: dict[str, None] = {}
    for csv in sorted(Path(folder).glob("*maximin*.csv")):
        names |= dict.fromkeys(pd.read_csv(csv, usecols=["press"]).press)
    return list(names)
