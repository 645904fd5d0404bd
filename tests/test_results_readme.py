"""results/README.md marks every folder of results/ as shipped, study or superseded, and the marks match the layout.

A folder to mark: every folder one or two levels below ``results/`` or below ``results/archive/``, except a
record's own subfolders (those of a folder that holds a ``*.jsonl`` itself, such as ``cpu-quick/report/``). A
table row names its folders in backticks in its first column, relative to ``results/``, with ``{a,b}`` and ``*``
allowed; its second column is the mark. Shipped folders stay at the top of ``results/``; study and superseded
folders live under ``results/archive/``. Every folder a row names exists.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
MARKS = ("shipped", "study", "superseded")


def expand(pattern: str) -> list[str]:
    """``a/{b,c}/`` -> ``["a/b", "a/c"]`` (one brace group at a time), trailing slashes dropped."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern.rstrip("/")]
    return [p for alt in m.group(1).split(",") for p in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def rows(text: str) -> list[tuple[list[str], str]]:
    """(folder patterns, mark) of each table row of results/README.md whose first column names folders."""
    found = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        found.append(([p for token in re.findall(r"`([^`]+)`", cells[0]) for p in expand(token)], cells[1]))
    return found


def folders() -> list[str]:
    """Every folder to mark, relative to results/."""
    out = []
    for base in (RESULTS, RESULTS / "archive"):
        for first in sorted(p for p in base.iterdir() if p.is_dir() and p.name not in ("archive", "demo")):
            out.append(str(first.relative_to(RESULTS)))
            if any(first.glob("*.jsonl")):
                continue  # a record: its subfolders are its own
            out += [str(second.relative_to(RESULTS)) for second in sorted(first.iterdir()) if second.is_dir()]
    return out


def marks() -> dict[str, str]:
    """folder -> its mark, from results/README.md (a folder named twice keeps its first mark)."""
    table = rows((RESULTS / "README.md").read_text())
    named: dict[str, str] = {}
    for folder in folders():
        for patterns, mark in table:
            if any(fnmatch.fnmatchcase(folder, p) for p in patterns):
                named.setdefault(folder, mark)
    return named


def test_every_folder_is_marked():
    unmarked = sorted(set(folders()) - set(marks()))
    assert not unmarked, (f"results/README.md marks no row for {unmarked}: add one (shipped at the top of results/, "
                          "study or superseded under results/archive/)")


@pytest.mark.parametrize("folder, mark", sorted(marks().items()))
def test_the_mark_matches_the_layout(folder, mark):
    assert mark in MARKS, f"{folder}: mark {mark!r} is not one of {MARKS}"
    archived = folder.startswith("archive/") or folder == "archive"
    where = "in" if archived else "outside"
    assert archived == (mark != "shipped"), f"{folder} is marked {mark} but lives {where} archive/"


def test_every_named_folder_exists():
    named = [p for patterns, _ in rows((RESULTS / "README.md").read_text()) for p in patterns]
    assert len(named) > 50
    missing = [p for p in named if not list(RESULTS.glob(p))]
    assert not missing, f"results/README.md names what does not exist: {missing}"


def test_the_reader_finds_what_it_checks(tmp_path):
    """The row parser: braces expand, the mark is the second column, a row without backticks is no row."""
    assert expand("a/{b,c}/") == ["a/b", "a/c"] and expand("x/") == ["x"]
    assert rows("| `a/`, `p/{q,r}/` | study | x |\n| folder | mark |\n") == [(["a", "p/q", "p/r"], "study")]
