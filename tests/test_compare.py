"""The comparison against the best top-k: the champion is the best mean at each ratio, and the
paired difference is the per-example difference of seed means."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from evaluation.report.compare import best_topk, markdown, score_means, versus_best


def frame():
    rng = np.random.default_rng(0)
    rows = []
    for i in range(10):
        base = rng.uniform(20, 80)
        for press, shift in (("tova", 0.0), ("knorm", -10.0)):
            for ratio, extra in ((0.25, 0.0), (0.5, -20.0 if press == "tova" else 0.0)):
                rows.append(dict(press=press, compression_ratio=ratio, seed=0, score=base + shift + extra))
        for seed in range(3):
            for ratio in (0.25, 0.5):
                rows.append(dict(press="prob_tova", compression_ratio=ratio, seed=seed, score=base - 3 + seed))
        rows.append(dict(press="full", compression_ratio=0.0, seed=0, score=base + 5))
        for row in rows[-(2 * 2 + 6 + 1):]:
            row.update(example_id=f"e{i}", task="niah_single_1")
    df = pd.DataFrame(rows)
    return df.assign(model="m", dataset="ruler", data_dir="1024")


def test_best_topk_is_the_best_mean_per_ratio():
    df = frame()
    best = best_topk(score_means(df[df["press"] != "full"]), ["tova", "knorm"])
    assert best == {0.25: "tova", 0.5: "knorm"}  # tova loses 20 points at r = 0.5


def test_difference_is_paired_on_seed_means():
    df = frame()
    diff = versus_best(df, ["prob_tova"], {0.25: "tova"}).iloc[0]
    assert diff["mean"] == pytest.approx(-2.0)  # seeds give -3, -2, -1 around tova
    assert diff["n"] == 10 and diff["lo"] == pytest.approx(-2.0)  # no spread: a degenerate interval
    at = df[df["compression_ratio"] == 0.5]
    prob = at[at["press"] == "prob_tova"].groupby("example_id")["score"].mean()
    knorm = at[at["press"] == "knorm"].set_index("example_id")["score"]
    d = (prob - knorm).to_numpy()
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    row = versus_best(df, ["prob_tova"], {0.5: "knorm"}).iloc[0]
    assert (row["mean"], row["lo"], row["hi"]) == pytest.approx((d.mean(), lo, hi))


def test_markdown_names_the_split_and_the_champion():
    text = markdown(frame(), "test")
    assert "(test split)" in text and "vs knorm" in text and "vs tova" in text and "Win scores" in text


def test_shared_examples_keep_only_examples_every_press_completed():
    from evaluation.report.aggregate import prepare
    from evaluation.report.compare import shared_examples

    df = prepare(frame())
    df = df[~((df["press"] == "knorm") & (df["example_id"] == "e3"))]  # knorm missing on one example
    shared = shared_examples(df, ["tova", "knorm", "prob_tova"])
    assert sorted(shared["example_id"].unique()) == sorted(f"e{i}" for i in range(10) if i != 3)
    assert set(shared["press"]) == {"tova", "knorm", "prob_tova", "full"}
