"""The maximin rule of docs/research/recommendation-rule.md over three regimes (RULER, prose, recall).

Each regime's records (RULER: ``score``, higher is better; prose and recall: ``kl``, lower is better)
become per (press, ratio) means over the examples every press of the regime ran (seeds averaged within
an example first). A press's relative score q in a regime at a ratio is its mean over the best press's
(RULER) or the best press's KL over its own (prose, recall), 1 being as good as the regime's best press
there; a regime's q is the mean over ratios. ``worst`` is the smallest of the three, ``mean`` their
mean. Candidates are the presses run in all three regimes whose bytes held on the cache (keys, values
and the correction bias, in every dtype measured) are at most ``1 + TOLERANCE`` times kvpress top-k's
(``snapkv``) at the same ratio, in every regime; a press whose records carry no bias bytes (and that no bytes
record measured) is refused.

    table = maximin(frames)                    # one row per press of all three: q's, worst, mean, held
    picks(table)                               # RECOMMENDED and the per-regime picks, with the tie-breaks
    intervals(frames, table)                   # each candidate's q against each regime's best, paired
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pandas as pd

from evaluation.report.aggregate import REFERENCE
from evaluation.report.stats import ratio_ci

REGIMES = {"ruler": ("score", True), "prose": ("kl", False), "recall": ("kl", False)}  # value, higher is better
TOLERANCE = 0.01
TIE = 0.01  # worst, mean and a regime's q within this of the best are tied
BYTES_TIE = 0.001  # held_vs_topk within this of the lowest is tied (0.1 % of top-k's bytes)
FAST = 1.2  # RECOMMENDED_FAST: prefill time (and, with a peak, prefill peak) at most this over snapkv's
DECODE = 1.10  # with decode steps: a candidate's decode step at most this over snapkv's (the price bench)
MERGE = 0.03  # RECOMMENDED_FAST becomes RECOMMENDED when its worst is within this of RECOMMENDED's
TOPK = ("snapkv", "tova", "keydiff")  # kvpress's top-k (the first present): every scorer keeps one count per head


def complete(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the examples on which every (press, ratio) of the frame ran."""
    cells = df.groupby("example_id").apply(lambda g: set(zip(g["press"], g["compression_ratio"])), include_groups=False)
    wanted = set().union(*cells) if len(cells) else set()
    return df[df["example_id"].isin(cells[cells.map(lambda c: c >= wanted)].index)]


def means(df: pd.DataFrame, value: str) -> pd.Series:
    """(press, ratio) -> the mean over examples of the seed-averaged ``value``, on the complete examples."""
    df = complete(df[df["press"] != REFERENCE])
    per_example = df.groupby(["press", "compression_ratio", "example_id"])[value].mean()
    return per_example.groupby(["press", "compression_ratio"]).mean()


def relative(m: pd.Series, higher: bool) -> pd.Series:
    """(press, ratio) -> q: m / best (higher is better) or best / m (lower is better), best per ratio."""
    best = m.groupby("compression_ratio").transform("max" if higher else "min")
    return m / best if higher else best / m


def held(df: pd.DataFrame) -> pd.Series:
    """(press, ratio) -> bytes held on the cache (kv_bytes + bias_bytes) over the full cache's, mean over examples,
    for the presses whose every row carries ``bias_bytes`` (the others' bytes are unknown, and left out).
    ``df``: records with the full cache's rows (``REFERENCE``), or a bytes record (``python -m evaluation.bench
    bytes``) whose rows carry ``full_bytes``."""
    rows = df[df["press"] != REFERENCE]
    if "bias_bytes" not in rows:
        return pd.Series(dtype=float, index=pd.MultiIndex.from_arrays([[], []], names=["press", "compression_ratio"]))
    rows = rows[~rows["press"].isin(rows.loc[rows["bias_bytes"].isna(), "press"])]
    if "full_bytes" in rows:
        full = rows["full_bytes"]
    else:
        full = rows["example_id"].map(df[df["press"] == REFERENCE].groupby("example_id")["kv_bytes"].first())
    ratio = (rows["kv_bytes"] + rows["bias_bytes"]) / full
    return ratio.groupby([rows["press"], rows["compression_ratio"]]).mean()


def held_vs_topk(df: pd.DataFrame, regime: str = "") -> pd.Series:
    """(press, ratio) -> ``held`` over kvpress top-k's (the first of ``TOPK`` whose bytes are known) at the same
    ratio; the largest over dtypes where ``df`` (a bytes record) has a ``dtype`` column."""
    if "dtype" in df:
        return pd.concat([held_vs_topk(d.drop(columns="dtype"), f"{regime} {t}") for t, d in df.groupby("dtype")]
                         ).groupby(level=[0, 1]).max()
    h = held(df)
    presses = h.index.get_level_values("press")
    topk = next((p for p in TOPK if p in presses), None)
    if topk is None:
        raise ValueError(f"{regime or 'a regime'}: no kvpress top-k press ({', '.join(TOPK)}) with known bytes "
                         f"(kv_bytes and bias_bytes) to compare with: measure them (python -m evaluation.bench bytes)")
    return h / h.xs(topk, level="press").reindex(h.index, level="compression_ratio").to_numpy()


def regime_held(records: pd.DataFrame, measured: pd.DataFrame | None, regime: str) -> pd.Series:
    """(press, ratio) -> held over top-k's in one regime: from the bytes record ``measured`` for the presses it
    holds (every dtype it measured), else from the records where they carry bias bytes; unknown presses absent."""
    found = [held_vs_topk(measured, regime)] if measured is not None else []
    if "bias_bytes" in records and records.loc[records["press"].isin(TOPK), "bias_bytes"].notna().any():
        found.append(held_vs_topk(records, regime))
    if not found:
        raise ValueError(f"{regime}: its records carry no bias_bytes and no bytes record was given: measure them "
                         f"(python -m evaluation.bench bytes)")
    return found[0] if len(found) == 1 else found[0].combine_first(found[1])


def maximin(frames: dict[str, pd.DataFrame], ratios=(0.5, 0.75), memory: dict[str, pd.DataFrame] | None = None
            ) -> pd.DataFrame:
    """One row per press run in every regime at every ratio: q per regime (``q_<regime>``, mean over
    ratios) and per ratio (``q_<regime>_<r>``), worst, mean, the largest held / top-k's held over every
    regime, ratio and dtype (``held_vs_topk``), ``candidate`` (within the tolerance), sorted by worst then
    mean. The bytes come from ``memory[regime]`` (a bytes record: ``python -m evaluation.bench bytes``) for the
    presses it holds, else from the regime's records where they carry ``bias_bytes``: a press whose bytes are
    unknown in some regime has no ``held_vs_topk`` and is no candidate."""
    columns, helds = {}, []
    for regime, (value, higher) in REGIMES.items():
        df = frames[regime]
        df = df[df["compression_ratio"].round(6).isin(ratios) | (df["press"] == REFERENCE)]
        q = relative(means(df, value), higher)
        for r in ratios:
            columns[f"q_{regime}_{r:g}"] = q.xs(r, level="compression_ratio")
        measured = None if memory is None or regime not in memory else memory[regime]
        if measured is not None:
            measured = measured[measured["compression_ratio"].round(6).isin(ratios)]
        helds.append(regime_held(df, measured, regime).groupby("press").max())
    table = pd.DataFrame(columns).dropna()
    for regime in REGIMES:
        table[f"q_{regime}"] = table[[f"q_{regime}_{r:g}" for r in ratios]].mean(axis=1)
    q = table[[f"q_{regime}" for regime in REGIMES]]
    table["worst"], table["mean"] = q.min(axis=1), q.mean(axis=1)
    table["worst_regime"] = q.idxmin(axis=1).str.removeprefix("q_")
    # the largest over regimes; a press whose bytes are unknown in a regime is unknown (NaN: no candidate)
    table["held_vs_topk"] = pd.concat([h.reindex(table.index) for h in helds], axis=1).max(axis=1, skipna=False)
    table["candidate"] = table["held_vs_topk"] <= 1 + TOLERANCE
    table.index.name = "press"
    return table.sort_values(["worst", "mean"], ascending=False)


def fields_set(obj, default=dataclasses.MISSING) -> int:
    """How many init fields of the dataclass ``obj`` are set away from their defaults, counted through the
    dataclasses it holds (a sampler, a proposal, an inner press): a field whose default is a dataclass of the
    value's type counts the fields set away inside it, any other differing field counts 1, and a field with
    no default counts what is set inside its value. ``compression_ratio`` is the press's budget, not a design
    choice, and is not counted. A value that is no dataclass counts 0."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return 0
    count = 0
    for f in dataclasses.fields(obj):
        if not f.init or f.name == "compression_ratio":
            continue
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            base = f.default
        elif f.default_factory is not dataclasses.MISSING:
            base = f.default_factory()
        else:
            count += fields_set(value)
            continue
        if dataclasses.is_dataclass(value) and type(base) is type(value):
            count += fields_set(value, base)
        elif dataclasses.is_dataclass(value) and base is None:
            count += 1 + fields_set(value)
        else:
            count += int(not _same(value, base))
    return count


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # tensors and arrays: compare by identity
        return a is b


def design_size(name: str) -> int:
    """``fields_set`` of the named press at r = 0.5 (the rule's "simpler design": fewer fields set away from
    their defaults)."""
    from kvpress_prob.names.registry import get_press

    return fields_set(get_press(name, 0.5))


def first(table: pd.DataFrame, score: str, size: Callable[[str], int] = design_size) -> str:
    """The rule's pick among ``table``'s rows by ``score`` (higher is better), ties broken as the rule says:
    the presses within ``TIE`` of the best score, then within ``TIE`` of the best mean, then within
    ``BYTES_TIE`` of the fewest bytes held over top-k's (fewer entries stored beside the kept ones), then the
    fewest fields set away from their defaults (``size``), then the first name in alphabetical order."""
    close = table[table[score] >= table[score].max() - TIE]
    close = close[close["mean"] >= close["mean"].max() - TIE]
    close = close[close["held_vs_topk"] <= close["held_vs_topk"].min() + BYTES_TIE]
    sizes = pd.Series({press: size(press) for press in close.index}, dtype=int)
    return sorted(sizes[sizes == sizes.min()].index)[0]


def picks(table: pd.DataFrame, size: Callable[[str], int] = design_size, prefill: pd.Series | None = None,
          peak: pd.Series | None = None, decode: pd.Series | None = None) -> dict[str, str]:
    """RECOMMENDED (the candidate with the highest worst) and the candidates with the highest RULER and
    prose q, each with the rule's tie-breaks (``first``). With ``decode`` (press -> decode step over
    snapkv's, from price records), a candidate also needs a decode step at most ``DECODE`` (an unpriced press
    is not one). With ``prefill`` (press -> prefill time over snapkv's), also RECOMMENDED_FAST: the same pick
    among the candidates whose prefill is at most ``FAST`` (and, with ``peak``, whose prefill peak is at most
    ``FAST`` too; an unpriced press is not one), which becomes RECOMMENDED too when its worst is within
    ``MERGE`` of RECOMMENDED's (the one it replaces is then RECOMMENDED_SLOW)."""
    cand = table[table["candidate"]]
    if decode is not None:
        cand = cand[[decode.get(press, float("inf")) <= DECODE for press in cand.index]]
    if cand.empty:
        raise ValueError("no candidate holds at most kvpress top-k's bytes (+1 %)"
                         + (f" with a decode step at most {DECODE} x snapkv's" if decode is not None else ""))
    chosen = {"RECOMMENDED": first(cand, "worst", size), "RECOMMENDED_RETRIEVAL": first(cand, "q_ruler", size),
              "RECOMMENDED_PROSE": first(cand, "q_prose", size)}
    if prefill is None:
        return chosen
    quick = [prefill.get(p, float("inf")) <= FAST and (peak is None or peak.get(p, float("inf")) <= FAST)
             for p in cand.index]
    fast = cand[quick]
    if fast.empty:
        return chosen
    chosen["RECOMMENDED_FAST"] = first(fast, "worst", size)
    quick, slow = chosen["RECOMMENDED_FAST"], chosen["RECOMMENDED"]
    if quick != slow and table.loc[quick, "worst"] >= table.loc[slow, "worst"] - MERGE:
        chosen["RECOMMENDED"], chosen["RECOMMENDED_SLOW"] = quick, slow
    return chosen


def intervals(frames: dict[str, pd.DataFrame], table: pd.DataFrame, ratios=(0.5, 0.75), level: float = 0.95,
              presses=None) -> pd.DataFrame:
    """Per regime and ratio, each of ``presses`` (default: the table's candidates) against that regime's best
    press of the pool there: q (as ``maximin``: mean / best mean for RULER, best KL / KL otherwise) with its
    paired percentile-bootstrap interval over the examples every press of the regime ran (``ratio_ci``,
    seeds averaged within an example first). One row per (press, regime, ratio): best, q, lo, hi, n."""
    presses = list(table.index[table["candidate"]] if presses is None else presses)
    rows = []
    for regime, (value, higher) in REGIMES.items():
        df = frames[regime]
        df = complete(df[df["compression_ratio"].round(6).isin(ratios) & (df["press"] != REFERENCE)])
        per = df.groupby(["press", "compression_ratio", "example_id"])[value].mean().unstack("example_id")
        for r in ratios:
            at = per.xs(r, level="compression_ratio")
            m = at.mean(axis=1)
            best = m.idxmax() if higher else m.idxmin()
            for press in presses:
                a, b = (at.loc[press], at.loc[best]) if higher else (at.loc[best], at.loc[press])
                q = ratio_ci(a.to_numpy(), b.to_numpy(), level)
                rows.append(dict(press=press, regime=regime, ratio=r, best=best, q=q["ratio"], lo=q["lo"],
                                 hi=q["hi"], n=q["n"]))
    return pd.DataFrame(rows)
