"""evaluation/report/pairs.py: paired scores and bytes held, the adaptive presses' bias counted."""

import argparse

import pandas as pd
import pytest

from evaluation.report.pairs import pair_table, parse_pair


def test_pair_table_pairs_examples_and_counts_the_bias_in_bytes_held():
    head_dim, full = 64, 1000.0
    rows = []
    for i in range(3):
        rows.append(dict(example_id=f"e{i}", press="full", compression_ratio=0.0, seed=0, score=50.0, kv_bytes=full))
        for seed in (0, 1):  # seeds are averaged within an example before pairing
            rows.append(dict(example_id=f"e{i}", press="snapkv_adaptive", compression_ratio=0.5, seed=seed,
                             score=10.0 * i + seed, kv_bytes=500.0))
        rows.append(dict(example_id=f"e{i}", press="adakv_snapkv", compression_ratio=0.5, seed=0,
                         score=10.0 * i, kv_bytes=full))
    rows.append(dict(example_id="e9", press="adakv_snapkv", compression_ratio=0.5, seed=0, score=99.0,
                     kv_bytes=full))  # no adaptive arm and no full record: left out of the pairing
    table = pair_table(pd.DataFrame(rows).query("example_id != 'e9' or press != 'full'"),
                       [("snapkv_adaptive", "adakv_snapkv")], head_dim)
    row = table.iloc[0]
    assert row["n"] == 3
    assert row["A - B"] == pytest.approx(0.5)  # (10 i + 0.5) - 10 i on every example
    assert row["score A"] == pytest.approx(10.5) and row["score B"] == pytest.approx(10.0)
    # a SamplingPress also holds its bias: one value per stored entry and KV head = kv_bytes / (2 head_dim)
    assert row["held A"] == pytest.approx((500 + 500 / (2 * head_dim)) / full)
    assert row["held B"] == pytest.approx(1.0)  # AdaKV masks: it keeps the whole cache, with no bias of ours


def test_parse_pair_refuses_what_is_not_two_names():
    assert parse_pair("a:b") == ("a", "b")
    for bad in ["ab", "a:", ":b"]:
        with pytest.raises(argparse.ArgumentTypeError, match="A:B"):
            parse_pair(bad)
