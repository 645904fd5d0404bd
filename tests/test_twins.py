"""evaluation/report/twins.py: paired differences of a press and its twin, overall and on one task."""

import pandas as pd

from evaluation.report.aggregate import prepare
from evaluation.report.twins import pair_rows


def test_twins_table_pairs_examples_and_reports_one_task():
    rows = []
    for i, task in enumerate(["fwe", "fwe", "niah_single_1", "niah_single_1"]):
        for press, score in [("keydiff_sum4", 10.0 * i), ("keydiff", 10.0 * i - 5 * (task == "fwe"))]:
            rows.append(dict(model="m", dataset="ruler", task=task, example_id=f"e{i}", press=press,
                             compression_ratio=0.5, seed=0, score=score))
    rows.append(dict(model="m", dataset="ruler", task="fwe", example_id="e9", press="keydiff",
                     compression_ratio=0.5, seed=0, score=99.0))  # unpaired: left out
    table = pair_rows(prepare(pd.DataFrame(rows)), [("keydiff_sum4", "keydiff")], "fwe")
    assert list(table.index) == ["keydiff_sum4 − keydiff (4 ex)", "keydiff_sum4 − keydiff (fwe only, 2 ex)"]
    assert table.iloc[0]["r = 0.5"].startswith("+2.5 [")
    assert table.iloc[1]["r = 0.5"].startswith("+5.0")
