"""Every results table in README.md and below docs/ names its records, and the counts it states are the records' own.

A *results table* is a markdown table with a measured number in its body (a decimal such as ``0.63`` or a
percentage such as ``12 %``) outside the first column and outside backticks. Within four lines above or below
it, a line starts with ``Records:`` and names the record folders or files it comes from, in backticks
(``results/...``), or says ``Records: none`` followed by why (a table of settings, not of measurements).

The counts the ``Records:`` line states are checked against the records: clauses separated by ``;``, each
``[RULER|prose|recall|stream] N examples|windows|streams`` with an optional ``N cues``. A count is the number
of distinct ``example_id`` in the named records of that dataset (the full-cache reference left out), over the
examples on which every press named in the table's first column (in backticks) that has such records ran;
cues add up each such example's ``cues``. A clause without a dataset word counts the one dataset the records
hold.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MEASURED = re.compile(r"\d\.\d|\d ?%")
PATH = re.compile(r"`(results/[^`\s]+)`")
COUNT = re.compile(r"(?:(RULER|prose|recall|stream)\S*\s+)?(\d+)\s+(examples|windows|streams)(?:[^;]*?(\d+)\s+cues)?",
                   re.IGNORECASE)


def tables(path: Path):
    """(first line number, lines) of each markdown table of ``path``."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-{3,}", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            yield i, lines, lines[i:j]
            i = j
        else:
            i += 1


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def is_results(table: list[str]) -> bool:
    body = [cells(r)[1:] for r in table[2:]]
    return any(MEASURED.search(re.sub(r"`[^`]*`", "", c)) for row in body for c in row)


def records_line(start: int, lines: list[str], n: int) -> str | None:
    near = lines[max(0, start - 4):start] + lines[start + n:start + n + 4]
    found = [line for line in near if line.lstrip("*_ ").startswith("Records:")]
    return found[0] if found else None


def cases():
    for path in DOCS:
        for start, lines, table in tables(path):
            if is_results(table):
                yield pytest.param(path, start, lines, table, id=f"{path.relative_to(ROOT)}:{start + 1}")


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        target = ROOT / p
        files = sorted(target.rglob("*.jsonl")) if target.is_dir() else [target] if target.suffix == ".jsonl" else []
        for f in files:
            for line in f.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    if "example_id" in r and "press" in r and r.get("press") != "full":
                        rows.append(r)
    return rows


def counts(rows: list[dict], presses: set[str]) -> dict[str, tuple[int, int]]:
    """dataset -> (examples, cues) over the examples every named press with records of that dataset ran."""
    ran: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    cues: dict[tuple[str, str], int] = {}
    for r in rows:
        dataset = str(r.get("dataset", "")).split("-")[0]
        ran[dataset][r["press"]].add(r["example_id"])
        cues[dataset, r["example_id"]] = int(r.get("cues", 0) or 0)
    out = {}
    for dataset, by_press in ran.items():
        named = [by_press[p] for p in presses if p in by_press] or list(by_press.values())
        examples = set.intersection(*named)
        out[dataset] = (len(examples), sum(cues[dataset, e] for e in examples))
    return out


@pytest.mark.parametrize("path, start, lines, table", list(cases()))
def test_a_results_table_names_its_records_and_their_counts(path, start, lines, table):
    line = records_line(start, lines, len(table))
    assert line is not None, f"{path.name}:{start + 1}: a results table with no 'Records:' line beside it"
    if line.lstrip("*_ ").startswith("Records: none"):
        assert len(line.split("none", 1)[1].strip(" .:-—()")) > 3, f"{path.name}:{start + 1}: say why no record"
        return
    paths = PATH.findall(line)
    assert paths, f"{path.name}:{start + 1}: the Records line names no results/ path"
    missing = [p for p in paths if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"{path.name}:{start + 1}: named records that do not exist: {missing}"
    claims = COUNT.findall(line)
    if not claims:
        return
    presses = {name for row in table[2:] for name in re.findall(r"`([a-z0-9_]+)`", cells(row)[0])}
    found = counts(load([p.rstrip("/") for p in paths]), presses)
    assert found, f"{path.name}:{start + 1}: counts stated but no store records under {paths}"
    for dataset, n, unit, n_cues in claims:
        key = dataset.lower() if dataset else None
        if key is None:
            assert len(found) == 1, f"{path.name}:{start + 1}: say which dataset '{n} {unit}' counts ({sorted(found)})"
            key = next(iter(found))
        assert key in found, f"{path.name}:{start + 1}: no {key} records under {paths}"
        examples, total_cues = found[key]
        assert int(n) == examples, f"{path.name}:{start + 1}: states {n} {unit} of {key}, the records hold {examples}"
        if n_cues:
            assert int(n_cues) == total_cues, f"{path.name}:{start + 1}: states {n_cues} cues, the records hold {total_cues}"


def test_the_checker_catches_a_wrong_count_and_a_missing_line(tmp_path):
    """Planted: the parser finds the table, its Records line and its count claims."""
    text = ["Records: `results/recall/test-1024` (recall 8 windows, 25 cues)", "",
            "| press | acc |", "|---|---|", "| `h2o` | 0.5 |"]
    (tmp_path / "a.md").write_text("\n".join(text))
    [(start, lines, table)] = list(tables(tmp_path / "a.md"))
    assert is_results(table) and records_line(start, lines, len(table)) == text[0]
    assert COUNT.findall(text[0]) == [("recall", "8", "windows", "25")]
    assert counts(load(["results/recall/test-1024"]), {"h2o"})["recall"] == (8, 25)
    (tmp_path / "b.md").write_text("\n".join(text[2:]))
    [(start, lines, table)] = list(tables(tmp_path / "b.md"))
    assert records_line(start, lines, len(table)) is None
