"""The maximin rule of docs/recommendation-rule.md over three regimes (RULER, prose, recall).

Each regime's records (RULER: ``score``, higher is better; prose and recall: ``kl``, lower is better)
become per (press, ratio) means over the examples every press of the regime ran (seeds averaged within
an example first). A press's relative score q in a regime at a ratio is its mean over the best press's
(RULER) or the best press's KL over its own (prose, recall), 1 being as good as the regime's best press
there; a regime's q is the mean over ratios. ``worst`` is the smallest of the three, ``mean`` their
mean. Candidates are the presses run in all three regimes whose bytes held on the cache are at most
``1 + TOLERANCE`` times kvpress top-k's (``snapkv``) at the same ratio.

    table = maximin(ruler, prose, recall)      # one row per press of all three: q's, worst, mean, held
    picks(table)                               # RECOMMENDED and the per-regime picks
"""

from __future__ import annotations

import pandas as pd

from evaluation.aggregate import REFERENCE

REGIMES = {"ruler": ("score", True), "prose": ("kl", False), "recall": ("kl", False)}  # value, higher is better
TOLERANCE = 0.01
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
    """(press, ratio) -> bytes held on the cache (kv_bytes + bias_bytes) over the full cache's, mean over examples."""
    full = df[df["press"] == REFERENCE].groupby("example_id")["kv_bytes"].first()
    rows = df[df["press"] != REFERENCE]
    ratio = (rows["kv_bytes"] + rows.get("bias_bytes", 0)) / rows["example_id"].map(full)
    return ratio.groupby([rows["press"], rows["compression_ratio"]]).mean()


def maximin(frames: dict[str, pd.DataFrame], ratios=(0.5, 0.75), memory=("prose", "recall")) -> pd.DataFrame:
    """One row per press run in every regime at every ratio: q per regime (``q_<regime>``, mean over
    ratios) and per ratio (``q_<regime>_<r>``), worst, mean, the largest held / top-k's held over the
    ``memory`` regimes and ratios (``held_vs_topk``), ``candidate`` (within the tolerance), sorted by
    worst then mean."""
    columns, helds = {}, []
    for regime, (value, higher) in REGIMES.items():
        df = frames[regime]
        df = df[df["compression_ratio"].round(6).isin(ratios) | (df["press"] == REFERENCE)]
        q = relative(means(df, value), higher)
        for r in ratios:
            columns[f"q_{regime}_{r:g}"] = q.xs(r, level="compression_ratio")
        if regime in memory:
            h = held(df)
            topk = next(p for p in TOPK if p in h.index.get_level_values("press"))
            helds.append(h / h.xs(topk, level="press").reindex(h.index, level="compression_ratio").to_numpy())
    table = pd.DataFrame(columns).dropna()
    for regime in REGIMES:
        table[f"q_{regime}"] = table[[f"q_{regime}_{r:g}" for r in ratios]].mean(axis=1)
    q = table[[f"q_{regime}" for regime in REGIMES]]
    table["worst"], table["mean"] = q.min(axis=1), q.mean(axis=1)
    table["worst_regime"] = q.idxmin(axis=1).str.removeprefix("q_")
    table["held_vs_topk"] = pd.concat(helds).groupby("press").max().reindex(table.index)
    table["candidate"] = table["held_vs_topk"] <= 1 + TOLERANCE
    table.index.name = "press"
    return table.sort_values(["worst", "mean"], ascending=False)


def picks(table: pd.DataFrame, tie: float = 0.01) -> dict[str, str]:
    """RECOMMENDED (highest worst among candidates; within ``tie`` of it, the highest mean) and the
    candidates with the highest RULER and prose q."""
    cand = table[table["candidate"]]
    if cand.empty:
        raise ValueError("no candidate holds at most kvpress top-k's bytes (+1 %)")
    close = cand[cand["worst"] >= cand["worst"].max() - tie]
    return {"RECOMMENDED": close["mean"].idxmax(), "RECOMMENDED_RETRIEVAL": cand["q_ruler"].idxmax(),
            "RECOMMENDED_PROSE": cand["q_prose"].idxmax()}
