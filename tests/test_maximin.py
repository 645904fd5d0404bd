"""The maximin rule (evaluation/report/maximin.py) on hand-made records: q per regime, worst, the memory check."""

import numpy as np
import pandas as pd
import pytest

from evaluation.report.maximin import maximin, picks


def _records(values: dict, column: str, held: dict | None = None) -> pd.DataFrame:
    rows = []
    for example in ("a", "b"):
        rows.append(dict(press="full", compression_ratio=0.0, seed=0, example_id=example, kv_bytes=1000, bias_bytes=0,
                         **{column: 0.0}))
        for (press, ratio), value in values.items():
            kv, bias = (held or {}).get(press, lambda r: (int(1000 * (1 - r)), 0))(ratio)
            for seed in (0, 1):
                rows.append(dict(press=press, compression_ratio=ratio, seed=seed, example_id=example, kv_bytes=kv,
                                 bias_bytes=bias, **{column: value + (0.1 if seed else -0.1) * value}))
    return pd.DataFrame(rows)


def test_worst_regime_decides_and_memory_is_checked():
    presses = {"snapkv": (40, 0.02, 0.04), "retrieval": (50, 0.06, 0.05), "prose": (10, 0.01, 0.03),
               "robust": (45, 0.015, 0.035), "fat": (60, 0.005, 0.01)}
    ruler = {(p, r): v[0] for p, v in presses.items() for r in (0.5, 0.75)}
    prose = {(p, r): v[1] for p, v in presses.items() for r in (0.5, 0.75)}
    recall = {(p, r): v[2] for p, v in presses.items() for r in (0.5, 0.75)}
    fat = {"fat": lambda r: (1000, 0)}
    table = maximin({"ruler": _records(ruler, "score", fat), "prose": _records(prose, "kl", fat),
                     "recall": _records(recall, "kl", fat)})
    # references: fat is best everywhere (it holds the full cache, still a reference)
    assert table.loc["robust", "q_ruler"] == pytest.approx(45 / 60)
    assert table.loc["robust", "q_prose"] == pytest.approx(0.005 / 0.015)
    assert table.loc["robust", "q_recall"] == pytest.approx(0.01 / 0.035)
    assert table.loc["robust", "worst"] == pytest.approx(min(45 / 60, 0.005 / 0.015, 0.01 / 0.035))
    assert not table.loc["fat", "candidate"] and table.loc["robust", "candidate"]
    p = picks(table, size=lambda press: 0)
    assert p["RECOMMENDED"] == "robust" and p["RECOMMENDED_RETRIEVAL"] == "retrieval"
    assert p["RECOMMENDED_PROSE"] == "prose"


def test_a_press_over_the_memory_tolerance_is_no_candidate():
    values = {(p, r): 1.0 for p in ("snapkv", "x") for r in (0.5, 0.75)}
    heavy = {"x": lambda r: (int(1000 * (1 - r)), 20)}  # bias: 1.04 x snapkv's 500 at r = 0.5, 1.08 at 0.75
    table = maximin({"ruler": _records(values, "score"), "prose": _records(values, "kl", heavy),
                     "recall": _records(values, "kl")})
    assert table.loc["x", "held_vs_topk"] == pytest.approx(1.08) and not table.loc["x", "candidate"]
    assert table.loc["snapkv", "candidate"]


def _table(rows: dict) -> pd.DataFrame:
    """A maximin table by hand: press -> (worst, mean, held_vs_topk); q_ruler = q_prose = worst."""
    t = pd.DataFrame({p: dict(worst=w, mean=m, held_vs_topk=h, q_ruler=w, q_prose=w, candidate=h <= 1.01)
                      for p, (w, m, h) in rows.items()}).T
    return t.astype({"worst": float, "mean": float, "held_vs_topk": float, "q_ruler": float, "q_prose": float,
                     "candidate": bool})


NO_SIZE = {}.get  # size() must not be consulted: the tie is broken earlier


def test_worst_within_the_margin_goes_to_the_higher_mean():
    t = _table({"a": (0.500, 0.60, 1.00), "b": (0.495, 0.70, 1.00), "c": (0.489, 0.90, 1.00)})
    assert picks(t, size=lambda p: 0)["RECOMMENDED"] == "b"  # c is 0.011 below a's worst: no tie


def test_mean_tie_goes_to_fewer_bytes_held():
    t = _table({"a": (0.500, 0.600, 1.008), "b": (0.500, 0.595, 1.000), "c": (0.500, 0.600, 1.0005)})
    # b and c hold within 0.001 of the fewest; the tie then goes to the smaller design
    assert picks(t, size={"b": 2, "c": 1}.get)["RECOMMENDED"] == "c"
    assert picks(t, size={"b": 1, "c": 2}.get)["RECOMMENDED"] == "b"


def test_last_ties_go_to_the_simpler_design_then_the_name():
    t = _table({"zeta": (0.5, 0.6, 1.0), "beta": (0.5, 0.6, 1.0), "alpha": (0.5, 0.6, 1.0)})
    assert picks(t, size={"zeta": 1, "beta": 2, "alpha": 3}.get)["RECOMMENDED"] == "zeta"
    assert picks(t, size=lambda p: 1)["RECOMMENDED"] == "alpha"


def test_a_press_over_the_memory_tolerance_is_never_picked():
    t = _table({"fat": (0.9, 0.9, 1.02), "thin": (0.1, 0.1, 1.0)})
    assert set(picks(t, size=lambda p: 0).values()) == {"thin"}


def test_fields_set_counts_fields_away_from_defaults_through_nested_dataclasses():
    from dataclasses import dataclass, field

    from evaluation.report.maximin import fields_set

    @dataclass
    class Inner:
        a: int = 1
        b: float = 0.5

    @dataclass
    class Press:
        compression_ratio: float = 0.0
        inner: Inner = field(default_factory=Inner)
        c: str = "x"

    assert fields_set(Press()) == 0
    assert fields_set(Press(compression_ratio=0.7)) == 0  # the budget is no design choice
    assert fields_set(Press(inner=Inner(a=2), c="y")) == 2
    assert fields_set(Press(inner=Inner(a=2, b=0.1))) == 2


def test_design_size_of_registered_presses():
    from evaluation.report.maximin import design_size

    assert design_size("snapkv") == 0
    assert design_size("prob_min_h_priority_head") > design_size("prob_min_h_priority")


def test_intervals_are_paired_q_against_each_regimes_best():
    from evaluation.report.maximin import intervals

    rng = np.random.default_rng(0)
    base = rng.uniform(1, 2, size=6)
    rows = []
    for i, x in enumerate(base):
        e = f"e{i}"
        rows.append(dict(press="full", compression_ratio=0.0, seed=0, example_id=e, kv_bytes=1000, bias_bytes=0,
                         score=100.0, kl=0.0))
        for r in (0.5, 0.75):
            for press, kl, score in (("best", x, 10 * x), ("snapkv", 2 * x, 5 * x),
                                     ("noisy", x * rng.uniform(1, 3), 10 * x * rng.uniform(0.3, 1))):
                rows.append(dict(press=press, compression_ratio=r, seed=0, example_id=e, kv_bytes=500,
                                 bias_bytes=0, score=score, kl=kl))
    df = pd.DataFrame(rows)
    frames = {"ruler": df, "prose": df, "recall": df}
    table = maximin(frames)
    out = intervals(frames, table, presses=["best", "snapkv", "noisy"]).set_index(["press", "regime", "ratio"])
    assert (out["best"] == "best").all() and (out["n"] == 6).all()
    # exact multiples on every example: the bootstrap cannot move q (powers of two scale sums exactly)
    for regime in ("ruler", "prose", "recall"):
        assert out.loc[("best", regime, 0.5), ["q", "lo", "hi"]].tolist() == [1.0, 1.0, 1.0]
        assert out.loc[("snapkv", regime, 0.5), ["q", "lo", "hi"]].tolist() == [0.5, 0.5, 0.5]
        noisy = out.loc[("noisy", regime, 0.75)]
        assert noisy["lo"] < noisy["q"] < noisy["hi"] and noisy["q"] < 1
        assert noisy["q"] == pytest.approx(table.loc["noisy", f"q_{regime}_0.75"])


def test_memory_is_checked_in_every_regime_and_dtype_and_unknown_bytes_are_refused():
    values = {(p, r): 1.0 for p in ("snapkv", "x") for r in (0.5, 0.75)}
    heavy = {"x": lambda r: (int(1000 * (1 - r)), 20)}  # 1.04 x snapkv's at r = 0.5, 1.08 at 0.75
    # over the tolerance on RULER alone: no longer a candidate (the filter read prose and recall only before)
    table = maximin({"ruler": _records(values, "score", heavy), "prose": _records(values, "kl"),
                     "recall": _records(values, "kl")})
    assert table.loc["x", "held_vs_topk"] == pytest.approx(1.08) and not table.loc["x", "candidate"]
    # RULER records without bias bytes: refused, naming the regime, unless a bytes record supplies them
    ruler = _records(values, "score").drop(columns="bias_bytes")
    frames = {"ruler": ruler, "prose": _records(values, "kl"), "recall": _records(values, "kl")}
    with pytest.raises(ValueError, match="ruler.*bias_bytes"):
        maximin(frames)
    # a bytes record that measured the top-k press only: x's bytes are unknown, so it is no candidate
    only_topk = pd.DataFrame([dict(press="snapkv", compression_ratio=r, seed=0, example_id="a", kv_bytes=500,
                                   bias_bytes=0, full_bytes=1000, dtype="float32") for r in (0.5, 0.75)])
    table = maximin(frames, memory={"ruler": only_topk})
    assert pd.isna(table.loc["x", "held_vs_topk"]) and not table.loc["x", "candidate"]
    assert table.loc["snapkv", "candidate"]
    measured = []
    for dtype, bias in (("float32", 0), ("bfloat16", 10)):  # x is over in bfloat16 only (1.04 / 1.02 x at 0.75 / 0.5)
        for r in (0.5, 0.75):
            kv = int(1000 * (1 - r))
            measured += [dict(press="snapkv", compression_ratio=r, seed=0, example_id="a", kv_bytes=kv // 2,
                              bias_bytes=0, full_bytes=500, dtype=dtype),
                         dict(press="x", compression_ratio=r, seed=0, example_id="a", kv_bytes=kv // 2,
                              bias_bytes=bias // 2 if dtype == "bfloat16" else 0, full_bytes=500, dtype=dtype)]
    table = maximin(frames, memory={"ruler": pd.DataFrame(measured)})
    assert table.loc["x", "held_vs_topk"] == pytest.approx(1 + 5 / 125) and not table.loc["x", "candidate"]
    assert table.loc["snapkv", "held_vs_topk"] == pytest.approx(1.0)


def test_the_fast_pick_and_the_merge():
    """RECOMMENDED_FAST: the best worst among candidates whose prefill is at most 1.2 x snapkv's (unpriced presses
    are not fast); it replaces RECOMMENDED when its worst is within 0.03, and not when it is further below."""
    t = _table({"slow": (0.50, 0.6, 1.0), "fast": (0.48, 0.5, 1.0), "faster": (0.30, 0.4, 1.0), "fat": (0.9, 0.9, 1.1),
                "unpriced": (0.49, 0.5, 1.0)})
    prefill = pd.Series({"slow": 4.0, "fast": 1.2, "faster": 0.9, "fat": 1.0})
    p = picks(t, size=lambda press: 0, prefill=prefill)
    assert p["RECOMMENDED_FAST"] == "fast" and p["RECOMMENDED"] == "fast" and p["RECOMMENDED_SLOW"] == "slow"
    t.loc["fast", ["worst", "q_ruler", "q_prose"]] = 0.465  # 0.035 below: no merge
    p = picks(t, size=lambda press: 0, prefill=prefill)
    assert p["RECOMMENDED_FAST"] == "fast" and p["RECOMMENDED"] == "slow" and "RECOMMENDED_SLOW" not in p
    assert "RECOMMENDED_FAST" not in picks(t, size=lambda press: 0, prefill=pd.Series({"slow": 4.0}))
    assert "RECOMMENDED_FAST" not in picks(t, size=lambda press: 0)


def test_the_decode_bound_and_the_fast_peak():
    """With decode steps, a candidate also needs one at most 1.10 x snapkv's (an unpriced press is no candidate);
    with a peak, RECOMMENDED_FAST also needs a prefill peak at most 1.2 x snapkv's."""
    t = _table({"best": (0.60, 0.7, 1.0), "slow_decode": (0.70, 0.8, 1.0), "cheap": (0.40, 0.5, 1.0),
                "lean": (0.35, 0.4, 1.0), "unpriced": (0.9, 0.9, 1.0)})
    decode = pd.Series({"best": 1.10, "slow_decode": 1.11, "cheap": 1.0, "lean": 0.99})
    p = picks(t, size=lambda press: 0, decode=decode)
    assert p["RECOMMENDED"] == "best" and p["RECOMMENDED_RETRIEVAL"] == "best"
    assert picks(t, size=lambda press: 0)["RECOMMENDED"] == "unpriced"  # without the bound, the best worst
    prefill = pd.Series({"best": 4.0, "slow_decode": 1.0, "cheap": 1.1, "lean": 1.0})
    peak = pd.Series({"best": 1.5, "slow_decode": 1.0, "cheap": 1.45, "lean": 1.01})
    assert picks(t, size=lambda press: 0, prefill=prefill, decode=decode)["RECOMMENDED_FAST"] == "cheap"
    assert picks(t, size=lambda press: 0, prefill=prefill, peak=peak, decode=decode)["RECOMMENDED_FAST"] == "lean"
    with pytest.raises(ValueError, match="decode step"):
        picks(t.loc[["slow_decode", "unpriced"]], size=lambda press: 0, decode=decode)
