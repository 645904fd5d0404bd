"""Tests of evaluation.report.aggregate on small hand-made frames with hand-computed answers."""

import math

import pandas as pd
import pytest

from evaluation.report.aggregate import (
    average_table,
    broadcast_reference,
    rank_extremes,
    score_table,
    task_ranks,
    uninformative_tasks,
    win_scores,
)


def rows(model, task, press, ratio, scores, seed=0, dataset="ruler"):
    """One record per score, examples e0, e1, ... of the task."""
    return [
        {"model": model, "dataset": dataset, "data_dir": "4096" if dataset == "ruler" else task, "task": task,
         "example_id": f"{task}-e{i}", "press": press, "compression_ratio": ratio, "seed": seed,
         "prediction": "", "answer": ["x"], "score": float(s), "realised_ratio": ratio, "kv_bytes": 0,
         "seconds": 0.0}
        for i, s in enumerate(scores)
    ]


def hand_frame(model="m1"):
    """3 methods, 2 units (t1 @ 0.5, t2 @ 0.5), plus the full reference.

    Method scores per unit (mean over examples, then over seeds):
      unit t1: a = (100+60)/2 = 80, b = 60, c = seeds (60+60)/2=60 and (50+70)/2=60 -> 60
      unit t2: a = 20, b = 20, c = seeds (20+40)/2=30 and (50+50)/2=50 -> 40
    """
    data = []
    data += rows(model, "t1", "a", 0.5, [100, 60])
    data += rows(model, "t1", "b", 0.5, [60, 60])
    data += rows(model, "t1", "c", 0.5, [60, 60], seed=0)
    data += rows(model, "t1", "c", 0.5, [50, 70], seed=1)
    data += rows(model, "t2", "a", 0.5, [20, 20])
    data += rows(model, "t2", "b", 0.5, [0, 40])
    data += rows(model, "t2", "c", 0.5, [20, 40], seed=0)
    data += rows(model, "t2", "c", 0.5, [50, 50], seed=1)
    # the reference beats everyone; it must not take part in the win score
    data += rows(model, "t1", "full", 0.0, [100, 100])
    data += rows(model, "t2", "full", 0.0, [100, 100])
    return pd.DataFrame(data)


def as_dict(table, col="win_score"):
    return dict(zip(table["press"], table[col]))


def test_win_score_hand_worked():
    # unit t1 (a=80, b=60, c=60): a beats b and c -> 2; b ties c -> 0.5; c ties b -> 0.5
    # unit t2 (a=20, b=20, c=40): a ties b -> 0.5; b ties a -> 0.5; c beats both -> 2
    # earned: a = 2.5, b = 1.0, c = 2.5; possible = 2 units x (3 - 1) = 4
    # win: a = 0.625, b = 0.25, c = 0.625; ranks a = c = 1, b = 3
    table = win_scores(hand_frame())
    assert set(table["press"]) == {"a", "b", "c"}, "the full reference is excluded"
    assert as_dict(table) == pytest.approx({"a": 0.625, "b": 0.25, "c": 0.625})
    assert as_dict(table, "rank") == {"a": 1, "b": 3, "c": 1}
    assert as_dict(table, "units") == {"a": 2, "b": 2, "c": 2}
    assert table["rank"].tolist() == sorted(table["rank"].tolist())
    assert list(table.columns) == ["press", "win_score", "rank", "units"]


def test_win_score_does_not_depend_on_full_reference():
    df = hand_frame()
    without = win_scores(df[df["press"] != "full"])
    assert as_dict(without) == as_dict(win_scores(df))


def test_win_score_missing_method_counts_only_present():
    # unit t3 (a=10, b=30, c absent): a earns 0 of 1, b earns 1 of 1
    # a = (2.5 + 0) / (4 + 1) = 0.5, b = (1 + 1) / 5 = 0.4, c = 2.5 / 4 = 0.625
    df = pd.concat([hand_frame(), pd.DataFrame(rows("m1", "t3", "a", 0.5, [10]) + rows("m1", "t3", "b", 0.5, [30]))])
    table = win_scores(df)
    assert as_dict(table) == pytest.approx({"a": 0.5, "b": 0.4, "c": 0.625})
    assert as_dict(table, "units") == {"a": 3, "b": 3, "c": 2}


def test_win_score_by_model_and_dataset():
    # m2, unit t1 @ 0.5: a=0, b=100, c=50 -> a 0/2, b 2/2, c 1/2
    m2 = pd.DataFrame(rows("m2", "t1", "a", 0.5, [0]) + rows("m2", "t1", "b", 0.5, [100])
                      + rows("m2", "t1", "c", 0.5, [50]))
    df = pd.concat([hand_frame("m1"), m2])
    by_model = win_scores(df, by="model")
    assert list(by_model.columns) == ["model", "press", "win_score", "rank", "units"]
    m1 = by_model[by_model["model"] == "m1"]
    assert as_dict(m1) == pytest.approx({"a": 0.625, "b": 0.25, "c": 0.625})
    assert as_dict(by_model[by_model["model"] == "m2"]) == pytest.approx({"a": 0.0, "b": 1.0, "c": 0.5})
    # overall: a = 2.5/6, b = 3/6, c = 3.5/6
    overall = win_scores(df)
    assert as_dict(overall) == pytest.approx({"a": 2.5 / 6, "b": 0.5, "c": 3.5 / 6})
    assert as_dict(overall, "rank") == {"c": 1, "b": 2, "a": 3}
    by_dataset = win_scores(df, by="dataset")
    assert set(by_dataset["dataset"]) == {"ruler"}
    assert as_dict(by_dataset) == pytest.approx(as_dict(overall))
    with pytest.raises(ValueError):
        win_scores(df, by="task")


def test_score_table_averages_seeds():
    table = score_table(hand_frame())
    c2 = table[(table["press"] == "c") & (table["task"] == "t2")].iloc[0]
    assert c2["score"] == pytest.approx(40.0)  # seeds 30 and 50
    assert c2["score_std"] == pytest.approx(math.sqrt(200))  # sample std of (30, 50)
    assert c2["n_seeds"] == 2 and c2["n_examples"] == 2
    a1 = table[(table["press"] == "a") & (table["task"] == "t1")].iloc[0]
    assert a1["score"] == 80.0 and a1["score_std"] == 0.0 and a1["n_seeds"] == 1


def test_score_table_mean_within_seed_first():
    # seed 0 has one example (0), seed 1 three (100, 100, 100): per seed 0 and 100 -> 50, not the pooled 75
    df = pd.DataFrame(rows("m", "t", "p", 0.5, [0], seed=0) + rows("m", "t", "p", 0.5, [100, 100, 100], seed=1))
    assert score_table(df)["score"].item() == pytest.approx(50.0)


def test_average_table():
    avg = average_table(hand_frame())
    ruler = avg[(avg["dataset"] == "ruler") & (avg["compression_ratio"] == 0.5)].set_index("press")
    # a: (80 + 20) / 2; b: (60 + 20) / 2; c: (60 + 40) / 2
    assert ruler["score"].to_dict() == pytest.approx({"a": 50.0, "b": 40.0, "c": 50.0})
    # c per seed: seed 0 (60 + 30) / 2 = 45, seed 1 (60 + 50) / 2 = 55 -> std sqrt(50)
    assert ruler.loc["c", "score_std"] == pytest.approx(math.sqrt(50))
    assert ruler.loc["c", "n_seeds"] == 2 and ruler.loc["a", "n_tasks"] == 2
    overall = avg[avg["dataset"] == "all"].set_index("press")
    assert overall.loc["a", "score"] == pytest.approx(50.0)
    assert overall.loc["full", "score"] == pytest.approx(100.0)
    # excluding a task (by name or by (model, dataset, task))
    for exclude in (["t2"], [("m1", "ruler", "t2")]):
        only_t1 = average_table(hand_frame(), exclude_tasks=exclude)
        t1 = only_t1[(only_t1["dataset"] == "ruler") & (only_t1["compression_ratio"] == 0.5)].set_index("press")
        assert t1["score"].to_dict() == pytest.approx({"a": 80.0, "b": 60.0, "c": 60.0})


def test_uninformative_tasks_flagged_and_excluded():
    df = hand_frame()
    # t3: the full cache scores 5 < 10, so no method can be told apart; b wins there
    df = pd.concat([df, pd.DataFrame(rows("m1", "t3", "full", 0.0, [0, 10]) + rows("m1", "t3", "a", 0.5, [0])
                                     + rows("m1", "t3", "b", 0.5, [10]) + rows("m1", "t3", "c", 0.5, [0]))])
    flagged = uninformative_tasks(df)
    assert flagged == {("m1", "ruler", "t3")}
    assert uninformative_tasks(df, threshold=4.0) == set()
    assert uninformative_tasks(df[df["press"] != "full"]) == set()
    with_t3 = win_scores(df)
    # t3: a ties c (0.5 each), b beats both (2): a = 3/6, b = 3/6, c = 3/6
    assert as_dict(with_t3) == pytest.approx({"a": 0.5, "b": 0.5, "c": 0.5})
    assert as_dict(win_scores(df, exclude=flagged)) == pytest.approx({"a": 0.625, "b": 0.25, "c": 0.625})


def test_broadcast_reference():
    df = pd.concat([hand_frame(), pd.DataFrame(rows("m1", "t1", "a", 0.75, [0, 0]))])
    shown = broadcast_reference(score_table(df))
    full_t1 = shown[(shown["press"] == "full") & (shown["task"] == "t1")]
    assert sorted(full_t1["compression_ratio"]) == [0.5, 0.75]
    assert (full_t1["score"] == 100.0).all()
    assert sorted(shown[(shown["press"] == "full") & (shown["task"] == "t2")]["compression_ratio"]) == [0.5]


def test_ruler_lengths_stay_apart():
    df = pd.DataFrame(rows("m", "vt", "a", 0.5, [100]) + rows("m", "vt", "b", 0.5, [0]))
    longer = pd.DataFrame(rows("m", "vt", "a", 0.5, [0]) + rows("m", "vt", "b", 0.5, [100]))
    longer["data_dir"] = "8192"
    table = score_table(pd.concat([df, longer]))
    assert sorted(set(table["task"])) == ["vt [4096]", "vt [8192]"]
    assert as_dict(win_scores(pd.concat([df, longer]))) == {"a": 0.5, "b": 0.5}


def task_rank_frame():
    """x: t1 (90, 70) -> 80, t2 (10, 10) -> 10; y: t1 50, t2 (60, 40) -> 50; z: t1 (20, 40) -> 30, t2 30."""
    data = []
    for press, t1, t2 in (("x", (90, 70), (10, 10)), ("y", (50, 50), (60, 40)), ("z", (20, 40), (30, 30))):
        for ratio, s1, s2 in zip((0.25, 0.75), t1, t2):
            data += rows("m", "t1", press, ratio, [s1]) + rows("m", "t2", press, ratio, [s2])
    data += rows("m", "t1", "full", 0.0, [100]) + rows("m", "t2", "full", 0.0, [100])
    return pd.DataFrame(data)


def test_task_ranks():
    ranks = task_ranks(task_rank_frame())
    assert "full" not in set(ranks["press"])
    got = {(t, p): r for t, p, r in zip(ranks["task"], ranks["press"], ranks["rank"])}
    assert got == {("t1", "x"): 1, ("t1", "y"): 2, ("t1", "z"): 3, ("t2", "y"): 1, ("t2", "z"): 2, ("t2", "x"): 3}
    x1 = ranks[(ranks["task"] == "t1") & (ranks["press"] == "x")].iloc[0]
    assert x1["score"] == pytest.approx(80.0) and x1["n_methods"] == 3
    ext = rank_extremes(ranks).set_index("press")
    # x collapses: first on t1, last on t2
    assert ext.loc["x", ["best_rank", "best_tasks", "worst_rank", "worst_of", "worst_tasks"]].tolist() == [
        1, "t1", 3, 3, "t2"]
    assert ext.loc["z", "best_tasks"] == "t2" and ext.loc["z", "worst_tasks"] == "t1"


def test_task_ranks_ties_share_best_rank():
    df = pd.DataFrame(rows("m", "t", "p", 0.5, [50]) + rows("m", "t", "q", 0.5, [50]) + rows("m", "t", "r", 0.5, [10]))
    assert as_dict(task_ranks(df), "rank") == {"p": 1, "q": 1, "r": 3}


def test_config_table_relates_bytes_to_the_full_cache_of_the_same_example():
    from evaluation.report.aggregate import config_table

    rows = []
    for ex, full_bytes in (("a", 1000), ("b", 2000)):
        rows.append(dict(model="m", dataset="d", data_dir="1", task="t", example_id=ex, press="full",
                         compression_ratio=0.0, seed=0, prediction="", answer=["x"], score=100.0,
                         realised_ratio=0.0, kv_bytes=full_bytes, seconds=1.0))
        rows.append(dict(model="m", dataset="d", data_dir="1", task="t", example_id=ex, press="p",
                         compression_ratio=0.5, seed=0, prediction="", answer=["x"], score=50.0,
                         realised_ratio=0.5, kv_bytes=full_bytes // 2 + (100 if ex == "a" else 0), seconds=2.0))
    table = config_table(pd.DataFrame(rows)).set_index("press")
    # (600 / 1000 + 1000 / 2000) / 2 = 0.55
    assert table.loc["p", "kv_fraction"] == pytest.approx(0.55)
    assert table.loc["full", "kv_fraction"] == 1.0 and table.loc["p", "score"] == 50.0
