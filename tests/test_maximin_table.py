"""The maximin command (``python -m evaluation.report.maximin_table``) and the frontier plot, against the committed
tables of results/archive/rule/ (the earlier tables, archived with their records): rerun on the committed records
with each table's own command, they write the same table."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from evaluation.report.frontier import main as frontier
from evaluation.report.maximin_table import main as maximin_table

ROOT = Path(__file__).resolve().parents[1]
RULE = ROOT / "results" / "archive" / "rule"
NEW = "python -m evaluation.report.maximin_table"


def _argv(table: str) -> list[str]:
    command = (RULE / table).read_text().splitlines()[2].removeprefix("Command: `").removesuffix("`")
    assert command.startswith(NEW)
    argv = shlex.split(command.removeprefix(NEW))
    if "--out" in argv:
        del argv[argv.index("--out"):argv.index("--out") + 2]
    return argv


@pytest.mark.parametrize("table", ["dev-maximin-round2.md", "test-maximin-round2.md"])
def test_a_table_written_before_bytes_were_checked_in_every_regime_is_refused(table, tmp_path, monkeypatch):
    """Round 2's tables read bytes on prose and recall only: their RULER records carry no bias bytes, so the
    command now refuses to judge memory on them rather than assume none."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match="ruler.*bias_bytes"):
        maximin_table([*_argv(table), "--out", str(tmp_path / table)])


@pytest.mark.parametrize("table", [t.name for t in sorted(RULE.glob("test-maximin-records*.md"))
                                   if "--bytes" in t.read_text().splitlines()[2]])
def test_the_command_rewrites_a_committed_table(table, tmp_path, monkeypatch):
    committed = (RULE / table).read_text().splitlines()
    argv = _argv(table)
    monkeypatch.chdir(ROOT)  # the record folders are named from the repository root
    out = maximin_table([*argv, "--out", str(tmp_path / table)])
    written = out.read_text().splitlines()
    assert written[2] == f"Command: `{NEW} " + " ".join(argv + ["--out", str(out)]) + "`"
    assert written[:2] + written[3:] == committed[:2] + committed[3:]  # the table and its paired intervals
    assert out.with_suffix(".csv").read_text() == (RULE / table).with_suffix(".csv").read_text()
    end = written.index("## Paired intervals per regime")
    assert any(line.startswith("### ") for line in written[end:])


def test_the_frontier_plot_is_written_beside_its_table(tmp_path):
    table = tmp_path / "test-maximin.csv"
    table.write_text((RULE / "test-maximin.csv").read_text())
    png = frontier([str(table)])
    assert png == tmp_path / "test-frontier.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_price_plot_is_written_beside_the_frontier(tmp_path):
    """With a price record, worst q against prefill time over snapkv's: a press the record lacks is named, not drawn."""
    table = tmp_path / "test-maximin.csv"
    table.write_text((RULE / "test-maximin.csv").read_text())
    record = tmp_path / "price.jsonl"
    record.write_text((ROOT / "results" / "bench" / "price" / "price.jsonl").read_text())
    png = frontier([str(table), "--price", str(record)])
    plot = tmp_path / "test-price.png"
    assert png == tmp_path / "test-frontier.png" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000
