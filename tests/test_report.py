"""Tests of evaluation.report.tables: files written, numbers in the markdown, valid PNGs."""

import pandas as pd
import pytest

from evaluation.report.tables import markdown_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rows(task, press, ratio, scores, seed=0, model="org/m1"):
    return [
        {"model": model, "dataset": "ruler", "data_dir": "4096", "task": task, "example_id": f"{task}-{i}",
         "press": press, "compression_ratio": ratio, "seed": seed, "prediction": "", "answer": ["x"],
         "score": float(s), "realised_ratio": ratio, "kv_bytes": 0, "seconds": 0.0}
        for i, s in enumerate(scores)
    ]


@pytest.fixture(scope="module")
def frame():
    """Two methods, two ratios, two informative tasks and one uninformative one (full scores 0 on cwe).

    niah: snapkv 80 @0.25, 40 @0.5; prob_min_h seeds (70, 90) -> 80 ± 14.1 @0.25, 60 @0.5; full 100
    vt:   snapkv 20 @0.25, 20 @0.5; prob_min_h 40 @0.25, 20 @0.5; full 60
    cwe:  snapkv 10, prob_min_h 0 at both ratios; full 0 (uninformative)
    """
    data = rows("niah", "full", 0.0, [100, 100]) + rows("vt", "full", 0.0, [60, 60]) + rows("cwe", "full", 0.0, [0, 0])
    data += rows("niah", "snapkv", 0.25, [80, 80]) + rows("niah", "snapkv", 0.5, [40, 40])
    data += rows("niah", "prob_min_h", 0.25, [70, 70], seed=0) + rows("niah", "prob_min_h", 0.25, [90, 90], seed=1)
    data += rows("niah", "prob_min_h", 0.5, [60, 60], seed=0) + rows("niah", "prob_min_h", 0.5, [60, 60], seed=1)
    data += rows("vt", "snapkv", 0.25, [20, 20]) + rows("vt", "snapkv", 0.5, [20, 20])
    for seed in (0, 1):
        data += rows("vt", "prob_min_h", 0.25, [40, 40], seed=seed) + rows("vt", "prob_min_h", 0.5, [20, 20], seed=seed)
        data += rows("cwe", "prob_min_h", 0.25, [0, 0], seed=seed) + rows("cwe", "prob_min_h", 0.5, [0, 0], seed=seed)
    data += rows("cwe", "snapkv", 0.25, [10, 10]) + rows("cwe", "snapkv", 0.5, [10, 10])
    return pd.DataFrame(data)


@pytest.fixture(scope="module")
def report(tmp_path_factory, frame):
    """The report of ``frame``, written once for the module."""
    out = tmp_path_factory.mktemp("out") / "report"
    return out, write_report(frame, out, "Tiny sweep")


def test_write_report_files_and_numbers(report):
    out, paths = report
    files = {k: v for k, v in paths.items() if k != "summary_markdown"}
    for name in ("report_md", "summary_md", "scores_csv", "average_csv", "average_informative_csv",
                 "win_scores_csv", "task_ranks_csv", "rank_extremes_csv", "plot_win",
                 "plot_average:org/m1", "plot_scores:org/m1:ruler"):
        assert name in files, name
    for path in files.values():
        assert path.exists() and path.stat().st_size > 0
        assert path.is_relative_to(out)

    md = paths["report_md"].read_text()
    assert md.startswith("# Tiny sweep")
    # per-task table for niah: full repeated at both ratios, prob_min_h with its seed spread
    assert "| full | 100.0 | 100.0 |" in md
    assert "| prob_min_h | 80.0 ± 14.1 | 60.0 ± 0.0 |" in md
    assert "| snapkv | 80.0 | 40.0 |" in md
    # average over the 3 tasks: snapkv (80+20+10)/3 = 36.7 @0.25, (40+20+10)/3 = 23.3 @0.5
    assert "| snapkv | 36.7 | 23.3 |" in md
    # without cwe: snapkv (80+20)/2 = 50.0, (40+20)/2 = 30.0; prob_min_h (80+40)/2 = 60.0, (60+20)/2 = 40.0
    assert "| snapkv | 50.0 | 30.0 |" in md
    assert "cwe †" in md and "† marks tasks on which the full cache scores under 10" in md
    # win score, all tasks: niah@.25 tie (0.5 each), niah@.5 prob wins, vt@.25 prob wins, vt@.5 tie,
    # cwe snapkv wins twice -> prob_min_h 3/6 = 0.500, snapkv 3/6 = 0.500;
    # without cwe: prob_min_h 3/4 = 0.750, snapkv 1/4 = 0.250
    assert "| prob_min_h | 0.500 | 1 | 6 | 0.750 | 1 |" in md
    assert "| snapkv | 0.500 | 1 | 6 | 0.250 | 2 |" in md
    # per-task ranks: prob_min_h first on niah (70 vs 60) and vt, last on cwe
    assert "| prob_min_h | 2/2 | 1/2 | 1/2 |" in md
    assert "](plots/win_scores.png)" in md

    summary = paths["summary_markdown"]
    assert "Tiny sweep" in summary and "| snapkv | 36.7 | 23.3 |" in summary
    assert "| prob_min_h | 0.500 | 1 | 6 | 0.750 | 1 |" in summary
    assert paths["summary_md"].read_text() == summary

    wins = pd.read_csv(paths["win_scores_csv"])
    overall = wins[(wins["scope"] == "overall") & (wins["tasks"] == "informative")].set_index("press")
    assert overall.loc["prob_min_h", "win_score"] == pytest.approx(0.75)
    assert set(wins["scope"]) == {"overall", "dataset", "model"}
    flagged = pd.read_csv(paths["uninformative_csv"])
    assert flagged.to_dict("records") == [{"model": "org/m1", "dataset": "ruler", "task": "cwe"}]


def test_plots_are_valid_pngs(report):
    from matplotlib.image import imread

    out, paths = report
    plots = [p for k, p in paths.items() if k.startswith("plot_")]
    assert len(plots) == 3
    for path in plots:
        assert path.read_bytes().startswith(PNG_MAGIC)
        image = imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert path.name.endswith(".png") and "/" not in path.name
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "no temporary files left"


def test_report_without_reference_or_seeds(tmp_path, frame):
    no_full = frame[(frame["press"] != "full") & (frame["seed"] == 0)]
    paths = write_report(no_full, tmp_path, "No reference")
    md = paths["report_md"].read_text()
    assert "No task is uninformative" in md
    assert "±" not in md.split("## Win score")[0]
    # seed 0 only: niah@.25 snapkv 80 > 70, so snapkv 3.5/6 = 0.583, prob_min_h 2.5/6 = 0.417
    assert "| snapkv | 0.583 | 1 | 6 |\n| prob_min_h | 0.417 | 2 | 6 |" in md
    assert "(no †)" not in md


def test_markdown_table():
    # numbers right-aligned, text left-aligned, NaN as a dash, pipes escaped
    table = pd.DataFrame({"a": [1.0, float("nan")], "b": ["x|y", "z"]}, index=pd.Index(["r1", "r2"], name="row"))
    assert markdown_table(table) == (
        "| row | a | b |\n| :--- | ---: | :--- |\n| r1 | 1.00 | x\\|y |\n| r2 | – | z |\n"
    )
