"""Statistics shared by the benchmarks and the aggregation: means with Student-t intervals and paired
differences with a paired t-test, from ``scipy.stats`` (docs/protocol.md, "Statistics").

The unit of replication is the example: a frame keyed by example (and seed) is first averaged over
the seeds within each example, then the interval is taken over the example means, so the
examples, not the draws, carry the uncertainty. Two arms are paired on the examples they share.

- ``mean_ci(values)`` / ``paired_difference(a, b)``: on plain arrays;
- ``bootstrap_ci(values)``: the percentile bootstrap interval of the mean;
- ``ratio_ci(a, b)``: mean(a) / mean(b) over paired units, with a paired bootstrap interval;
- ``example_means(frame, value, by)``: the seed-averaged value per example;
- ``mean_table(frame, value, by)``: mean and t-interval per group;
- ``paired_table(frame, value, arm, a, b, by)``: arm a minus arm b per group, with the paired test.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

UNIT = "example_id"


def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=float).ravel()
    return x[np.isfinite(x)]


def mean_ci(values, level: float = 0.95) -> dict:
    """Mean and two-sided Student-t interval of the mean of i.i.d. values (NaN and inf dropped).

    Returns {mean, lo, hi, half, n, sd}; lo / hi / half / sd are NaN with fewer than two values,
    and lo = hi = mean when the values are all equal.
    """
    x = _finite(values)
    n = len(x)
    nan = float("nan")
    if n == 0:
        return {"mean": nan, "lo": nan, "hi": nan, "half": nan, "n": 0, "sd": nan}
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "lo": nan, "hi": nan, "half": nan, "n": 1, "sd": nan}
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2.0, n - 1) * sd / np.sqrt(n))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "half": half, "n": n, "sd": sd}


def paired_difference(a, b, level: float = 0.95) -> dict:
    """Mean of a - b over paired units with its t-interval (``mean_ci``), the two-sided paired
    t-test (``scipy.stats.ttest_rel``: t, p_value; NaN with fewer than two pairs or no spread) and
    ``a_better``, the count of units with a < b (lower is better)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same shape, got {a.shape} and {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    out = mean_ci(a - b, level)
    t, p = float("nan"), float("nan")
    if len(a) >= 2 and np.ptp(a - b) > 0:
        test = stats.ttest_rel(a, b)
        t, p = float(test.statistic), float(test.pvalue)
    return out | {"t": t, "p_value": p, "a_better": int(np.sum(a < b))}


def bootstrap_ci(values, level: float = 0.95, n_boot: int = 10000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (``scipy.stats.bootstrap``, seeded); NaN with
    fewer than two values."""
    x = _finite(values)
    if len(x) < 2:
        return float("nan"), float("nan")
    if np.ptp(x) == 0:
        return float(x[0]), float(x[0])
    res = stats.bootstrap((x,), np.mean, n_resamples=n_boot, confidence_level=level, method="percentile",
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def example_means(frame: pd.DataFrame, value: str, by: list[str], unit: str = UNIT) -> pd.DataFrame:
    """``value`` averaged over the rows (seeds) of each (by..., unit): one row per group and example."""
    return frame.groupby([*by, unit], sort=False, dropna=False)[value].mean().reset_index()


def mean_table(frame: pd.DataFrame, value: str, by: list[str] | None = None, unit: str = UNIT, level: float = 0.95) -> pd.DataFrame:
    """Per group of ``by`` (none: one row): the mean over examples of the seed-averaged ``value``
    with its t-interval (columns by..., mean, lo, hi, half, n, sd; n counts examples)."""
    by = list(by or [])
    means = example_means(frame, value, by, unit)
    groups = means.groupby(by, sort=False, dropna=False) if by else [((), means)]
    rows = [dict(zip(by, key if isinstance(key, tuple) else (key,))) | mean_ci(g[value], level) for key, g in groups]
    return pd.DataFrame(rows, columns=[*by, "mean", "lo", "hi", "half", "n", "sd"])


def paired_table(frame: pd.DataFrame, value: str, arm: str, a, b, by: list[str] | None = None, unit: str = UNIT,
                 level: float = 0.95) -> pd.DataFrame:
    """Per group of ``by``: arm ``a`` minus arm ``b`` of the seed-averaged ``value``, paired on the
    examples both have (``paired_difference``), with each arm's mean over those examples (mean_a,
    mean_b). Groups where the arms share no example are left out."""
    by = list(by or [])
    means = example_means(frame[frame[arm].isin([a, b])], value, [*by, arm], unit)
    rows = []
    groups = means.groupby(by, sort=False, dropna=False) if by else [((), means)]
    for key, g in groups:
        wide = g.pivot(index=unit, columns=arm, values=value)
        if a not in wide or b not in wide:
            continue
        wide = wide[[a, b]].dropna()
        if wide.empty:
            continue
        key = key if isinstance(key, tuple) else (key,)
        rows.append(dict(zip(by, key)) | {"a": a, "b": b, "mean_a": float(wide[a].mean()), "mean_b": float(wide[b].mean())}
                    | paired_difference(wide[a].to_numpy(), wide[b].to_numpy(), level))
    columns = [*by, "a", "b", "mean_a", "mean_b", "mean", "lo", "hi", "half", "n", "sd", "t", "p_value", "a_better"]
    return pd.DataFrame(rows, columns=columns)


def ratio_ci(a, b, level: float = 0.95, n_boot: int = 10000, seed: int = 0) -> dict:
    """mean(a) / mean(b) over paired units, with the percentile bootstrap interval that resamples the
    units (the pairs) together (``scipy.stats.bootstrap``, ``paired=True``, seeded). Returns {ratio, lo,
    hi, n}; lo / hi are NaN with fewer than two pairs."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same shape, got {a.shape} and {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    nan = float("nan")
    if len(a) == 0 or b.mean() == 0:
        return {"ratio": nan, "lo": nan, "hi": nan, "n": len(a)}
    ratio = float(a.mean() / b.mean())
    if len(a) < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return {"ratio": ratio, "lo": nan if len(a) < 2 else ratio, "hi": nan if len(a) < 2 else ratio, "n": len(a)}
    res = stats.bootstrap((a, b), lambda x, y, axis: x.mean(axis=axis) / y.mean(axis=axis), paired=True,
                          vectorized=True, n_resamples=n_boot, confidence_level=level, method="percentile",
                          rng=np.random.default_rng(seed))
    return {"ratio": ratio, "lo": float(res.confidence_interval.low), "hi": float(res.confidence_interval.high),
            "n": len(a)}
