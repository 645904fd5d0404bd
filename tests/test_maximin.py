"""The maximin rule (evaluation/maximin.py) on hand-made records: q per regime, worst, the memory check."""

import pandas as pd
import pytest

from evaluation.maximin import maximin, picks


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
    p = picks(table)
    assert p["RECOMMENDED"] == "robust" and p["RECOMMENDED_RETRIEVAL"] == "retrieval"
    assert p["RECOMMENDED_PROSE"] == "prose"


def test_a_press_over_the_memory_tolerance_is_no_candidate():
    values = {(p, r): 1.0 for p in ("snapkv", "x") for r in (0.5, 0.75)}
    heavy = {"x": lambda r: (int(1000 * (1 - r)), 20)}  # bias: 1.04 x snapkv's 500 at r = 0.5, 1.08 at 0.75
    table = maximin({"ruler": _records(values, "score"), "prose": _records(values, "kl", heavy),
                     "recall": _records(values, "kl")})
    assert table.loc["x", "held_vs_topk"] == pytest.approx(1.08) and not table.loc["x", "candidate"]
    assert table.loc["snapkv", "candidate"]
