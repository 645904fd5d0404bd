"""evaluation/report/stats.py against printed t tables, closed forms and hand computation."""

import math

import numpy as np
import pandas as pd
import pytest

from evaluation.report import stats

# two-sided 95% Student-t quantiles t_{0.975, df} from printed tables
T975 = {1: 12.706205, 2: 4.302653, 4: 2.776445, 5: 2.570582, 29: 2.045230}


@pytest.mark.parametrize("df", sorted(T975))
def test_mean_ci_uses_the_t_quantile_of_the_tables(df):
    x = np.arange(df + 1, dtype=float) ** 1.5
    ci = stats.mean_ci(x)
    half = T975[df] * x.std(ddof=1) / math.sqrt(df + 1)
    assert ci["half"] == pytest.approx(half, rel=1e-6)
    assert (ci["lo"], ci["hi"]) == pytest.approx((x.mean() - half, x.mean() + half), abs=1e-5)
    assert ci["n"] == df + 1 and ci["sd"] == pytest.approx(x.std(ddof=1))


def test_mean_ci_levels_and_degenerate_cases():
    assert stats.mean_ci([1, 2, 3, 4, 5], level=0.9)["half"] < stats.mean_ci([1, 2, 3, 4, 5])["half"]
    one = stats.mean_ci([0.7])
    assert one["mean"] == 0.7 and one["n"] == 1 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    const = stats.mean_ci([2.0, 2.0, 2.0])
    assert const["lo"] == const["hi"] == 2.0
    assert stats.mean_ci([1.0, float("nan"), 3.0])["n"] == 2  # NaN dropped
    assert stats.mean_ci([])["n"] == 0


def test_paired_difference_against_the_closed_form_for_two_degrees_of_freedom():
    """With 3 pairs (df = 2) the t CDF is 1/2 + t / (2 sqrt(2 + t^2)), so p = 1 - |t| / sqrt(2 + t^2)."""
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.5, 2.0])
    d = stats.paired_difference(a, b)
    diff = a - b
    t = diff.mean() / (diff.std(ddof=1) / math.sqrt(3))
    assert d["mean"] == pytest.approx(diff.mean()) and d["t"] == pytest.approx(t)
    assert d["p_value"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-9)
    assert d["a_better"] == 2 and d["n"] == 3
    assert (d["lo"], d["hi"]) == pytest.approx(
        (diff.mean() - T975[2] * diff.std(ddof=1) / math.sqrt(3), diff.mean() + T975[2] * diff.std(ddof=1) / math.sqrt(3)),
        rel=1e-6)
    assert math.isnan(stats.paired_difference([1.0, 2.0], [0.0, 1.0])["p_value"])  # no spread: no test
    with pytest.raises(ValueError):
        stats.paired_difference([1.0], [1.0, 2.0])


def test_bootstrap_ci_brackets_the_mean_and_is_seeded():
    x = [0.1, 0.4, 0.2, 0.9, 0.3, 0.5]
    lo, hi = stats.bootstrap_ci(x, n_boot=4000)
    assert min(x) <= lo < np.mean(x) < hi <= max(x)
    assert stats.bootstrap_ci(x, n_boot=4000) == (lo, hi)
    assert all(math.isnan(v) for v in stats.bootstrap_ci([1.0]))


def _frame():
    """Two presses on three examples, two seeds each; press b is press a + 1 on e0, e1 and a - 1 on e2."""
    rows = []
    for i, base in enumerate([1.0, 2.0, 4.0]):
        for seed, noise in ((0, -0.5), (1, 0.5)):
            rows.append(dict(example_id=f"e{i}", seed=seed, press="a", ratio=0.5, kl=base + noise))
            rows.append(dict(example_id=f"e{i}", seed=seed, press="b", ratio=0.5, kl=base + (1 if i < 2 else -1)))
    rows.append(dict(example_id="e3", seed=0, press="a", ratio=0.5, kl=100.0))  # unpaired: left out of paired tables
    return pd.DataFrame(rows)


def test_tables_average_seeds_within_examples_then_pair_on_shared_examples():
    frame = _frame()
    table = stats.mean_table(frame, "kl", ["press"]).set_index("press")
    ci = stats.mean_ci([1.0, 2.0, 4.0, 100.0])  # the seed means of a; seeds are not units
    assert table.loc["a", "n"] == 4 and table.loc["a", "mean"] == pytest.approx(ci["mean"])
    assert table.loc["a", "hi"] == pytest.approx(ci["hi"])
    assert stats.mean_table(frame, "kl").iloc[0]["n"] == 4  # no grouping: one row
    paired = stats.paired_table(frame, "kl", "press", "a", "b", by=["ratio"])
    assert len(paired) == 1
    row = paired.iloc[0]
    expected = stats.paired_difference([1.0, 2.0, 4.0], [2.0, 3.0, 3.0])
    assert row["n"] == 3 and row["mean"] == pytest.approx(expected["mean"]) and row["a_better"] == 2
    assert row["p_value"] == pytest.approx(expected["p_value"])
    assert (row["mean_a"], row["mean_b"]) == pytest.approx((7 / 3, 8 / 3))
    assert stats.paired_table(frame, "kl", "press", "a", "missing").empty
