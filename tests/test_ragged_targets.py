"""experiments.ragged_targets: the side-by-side means and paired differences, against sums written out by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from experiments.ragged_targets import levels, pair_row


def records(values: dict[tuple[str, float], list[float]], column: str, seeds: int = 2) -> pd.DataFrame:
    """One row per (press, ratio, example, seed); seed s adds s - (seeds - 1) / 2 (the seed mean is the value)."""
    rows = []
    for (press, ratio), per_example in values.items():
        for i, v in enumerate(per_example):
            for s in range(seeds):
                rows.append({"press": press, "compression_ratio": ratio, "example_id": f"e{i}", "seed": s,
                             column: v + s - (seeds - 1) / 2})
    return pd.DataFrame(rows)


def test_ruler_means_pair_on_the_examples_every_press_ran_and_the_full_cache_shows_at_every_ratio():
    df = records({("a", 0.5): [10, 20, 30, 40], ("b", 0.5): [5, 25, 20], ("full", 0.0): [50, 60, 70, 80]}, "score")
    means, n = levels(df, "ruler", ["full", "a", "b"], [0.5])
    assert n == 3  # example e3 has no record of b
    assert means.loc["a", 0.5] == pytest.approx(20.0) and means.loc["b", 0.5] == pytest.approx(50 / 3)
    assert means.loc["full", 0.5] == pytest.approx(60.0)
    d = np.array([10 - 5, 20 - 25, 30 - 20], dtype=float)
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    cell = pair_row(df, "ruler", "a", "b", 0.5)
    assert cell["n"] == 3 and cell["cell"] == f"{d.mean():+.1f} [{d.mean() - half:+.1f}, {d.mean() + half:+.1f}]"


def test_prose_is_over_h2os_kl_at_the_same_ratio_and_pairs_as_a_ratio():
    df = records({("a", 0.9): [0.2, 0.4], ("h2o", 0.9): [0.4, 0.4], ("a", 0.5): [0.1, 0.1], ("h2o", 0.5): [0.5, 0.3]},
                 "kl", seeds=1)
    means, n = levels(df, "prose", ["a"], [0.5, 0.9])
    assert n == 2 and list(means.index) == ["a"]
    assert means.loc["a", 0.9] == pytest.approx(0.3 / 0.4) and means.loc["a", 0.5] == pytest.approx(0.1 / 0.4)
    assert pair_row(df, "prose", "a", "h2o", 0.9)["cell"].startswith(f"{0.3 / 0.4:.2f} ×")


def test_a_press_without_records_is_named():
    df = records({("a", 0.75): [1.0]}, "acc")
    with pytest.raises(ValueError, match=r"recall: no records of \[\('b', 0.75\)\]"):
        levels(df, "recall", ["a", "b"], [0.75])
