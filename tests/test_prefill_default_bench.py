"""The prefill-default bench's summary (experiments/prefill_default.py): each press's time
over snapkv's in the same round, the median over rounds; groups already written are skipped."""

import pytest

from experiments.prefill_default import done_groups, markdown, summarise


def row(n, rep, press, seconds):
    return {"n": n, "repeat": rep, "press": press, "seconds": seconds, "cpu_seconds": seconds, "extra_bytes": 2**20,
            "full_kv_bytes": 180 * 2**20}


def test_ratios_are_paired_by_round_and_the_median_is_over_rounds():
    rows = [row(4096, 0, "snapkv", 10.0), row(4096, 0, "prob_snapkv", 11.0),
            row(4096, 1, "snapkv", 20.0), row(4096, 1, "prob_snapkv", 21.0),
            row(4096, 2, "snapkv", 10.0), row(4096, 2, "prob_snapkv", 10.5)]
    table = summarise(rows, ["snapkv", "prob_snapkv"])["4096"]
    # per round 1.1, 1.05, 1.05: median 1.05 (an unpaired ratio of medians would be 11 / 10 = 1.1)
    assert table["prob_snapkv"]["over_snapkv_rounds"] == pytest.approx([1.1, 1.05, 1.05])
    assert table["prob_snapkv"]["over_snapkv"] == pytest.approx(1.05)
    assert table["snapkv"]["over_snapkv"] == 1.0 and table["prob_snapkv"]["rounds"] == 3
    assert done_groups(rows) == {(4096, 0), (4096, 1), (4096, 2)}
    text = markdown(summarise(rows, ["snapkv", "prob_snapkv"]), {
        "command": "x", "machine": {"cpu_count": 2, "torch": "t"}, "threads": 1, "model": "m", "ratio": 0.5})
    assert "| prob_snapkv | 3 |" in text and "**1.050**" in text
