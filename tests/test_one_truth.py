"""One answer everywhere: README.md and every page below docs/ state the registry's recommendations, or none.

A *statement* of a recommendation ties a registered press name to a role, with nothing between them but
connecting words and punctuation (``=``, ``:``, ``(``, ``|``, ``is``, ``the``, ``previous``, ``round 2's``, ...):

- a constant's value (several constants may share it: "| default, prose (`RECOMMENDED`, `RECOMMENDED_PROSE`) | `x` |"): ``RECOMMENDED = x``, "`RECOMMENDED` (`x`)", "| default (`RECOMMENDED`) | `x` |",
  "`x` (the previous `RECOMMENDED`)", ``RECOMMENDED_PROSE: x`` -> the constant must name x;
- a role word: "x is the default" (``RECOMMENDED``), "x, the fast press" (``RECOMMENDED_FAST``; not "Fast
  KVzip"), "for prose: x" (``RECOMMENDED_PROSE``), "x for retrieval" (``RECOMMENDED_RETRIEVAL``) -> that
  constant must name x; "recommended" / "recommendation" -> x must be one of the four.

The text is read whole (code blocks included: ``RECOMMENDED = "x"`` is a statement too), links' targets and paths
left out. Exempt: the dated entries (``## YYYY-MM-DD ...`` sections) of docs/research/history.md, the one page of
past picks. The constants are read from ``kvpress_prob.names.registry`` when a check runs, so a test that changes
one (``monkeypatch``) sees every statement of the old pick fail. The docs name current picks by their constant
or through the generated table, so that a new pick needs no edit of theirs.

Also here: the README's table is the generated one; counts of presses are the code's; README.md and docs/*.md
carry no "round N" / "issue N"; README.md has at most 2,000 words.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from kvpress_prob.names import registry

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
HISTORY = ROOT / "docs" / "research" / "history.md"
CONSTANTS = ("RECOMMENDED", "RECOMMENDED_FAST", "RECOMMENDED_PROSE", "RECOMMENDED_RETRIEVAL", "RECOMMENDED_SLOW")
ROLE_WORDS = {"default": "RECOMMENDED", "fast": "RECOMMENDED_FAST"}
FOR_ROLES = {"prose": "RECOMMENDED_PROSE", "retrieval": "RECOMMENDED_RETRIEVAL"}
ANY = "any"  # "recommended": one of the four
CONNECT = {"=", ":", "(", ")", ",", "|", "→", "->", "*", "'", '"', "s", "is", "was", "are", "stays", "remains", "becomes",
           "became", "now", "the", "a", "as", "our", "its", "previous", "old", "former", "past", "earlier", "then",
           "new", "current", "round", "press", "pick", "choice", "named", "names", "still", "also", "and", "=="}
TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|->|==|[^\sA-Za-z0-9_`]")
GAP = 6  # at most this many connecting tokens between a role and a press


@functools.lru_cache(maxsize=None)
def _builds(word: str) -> bool:
    """Whether ``word`` names a prefill or decoding press (the names do not change while the tests run)."""
    from kvpress_prob import DECODING_PRESSES, PRESSES

    return bool(re.fullmatch(r"[a-z][a-z0-9_]*", word)) and (word in PRESSES or word in DECODING_PRESSES)


def registered(word: str) -> bool:
    return _builds(word) or (bool(re.fullmatch(r"[a-z][a-z0-9_]*", word))
                             and word in {getattr(registry, c) for c in CONSTANTS})


def exempt_lines(path: Path, lines: list[str]) -> set[int]:
    """Line numbers (1-based) of the dated entries of the history page."""
    if path != HISTORY:
        return set()
    out, dated = set(), False
    for i, line in enumerate(lines, 1):
        if re.match(r"^#{1,3} ", line):
            dated = bool(re.match(r"^#{1,3} \d{4}-\d{2}-\d{2}\b", line))
        if dated:
            out.add(i)
    return out


def tokens(text: str) -> list[tuple[int, str]]:
    """(line, token) of ``text``: links' targets, URLs and paths (anything with a ``/`` or ending ``.md``) dropped."""
    text = re.sub(r"\]\([^)\s]*\)", "]", text)
    text = re.sub(r"[^\s`|()\[\]]*(?:/|\.md\b)[^\s`|()\[\]]*", " ", text)
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        out += [(number, t) for t in TOKEN.findall(line)]
    return out


def statements(path: Path, text: str | None = None) -> list[tuple[int, str, str]]:
    """(line, role, press) of every statement in a page: role is a constant's name, or ``ANY``."""
    text = path.read_text() if text is None else text
    skip = exempt_lines(path, text.split("\n"))
    toks = tokens(text)
    roles, presses = [], []  # (index, role) / (index, press)
    for i, (_, t) in enumerate(toks):
        low, prev = t.lower(), toks[i - 1][1].lower() if i else ""
        nxt = toks[i + 1][1].lower() if i + 1 < len(toks) else ""
        if t in CONSTANTS:
            roles.append((i, t))
        elif low in ("recommended", "recommendation", "recommendations", "recommend"):
            roles.append((i, ANY))
        elif low in ROLE_WORDS and not (low == "fast" and nxt in ("kvzip", "path", "paths")):
            roles.append((i, ROLE_WORDS[low]))
        elif low in FOR_ROLES and prev == "for":
            roles.append((i, FOR_ROLES[low]))
        elif registered(t):
            presses.append((i, t))
    found = set()
    for r, role in roles:
        for p, press in presses:
            lo, hi = min(r, p), max(r, p)
            if hi - lo > GAP + 2:
                continue  # more than GAP tokens between them, even with "for" dropped below
            between = [t.lower() for _, t in toks[lo + 1:hi]]
            if role in FOR_ROLES.values() and p < r and between[-1:] == ["for"]:
                between = between[:-1]  # "x for prose": "for" belongs to the role
            if p < r and "," in between:
                continue  # "a, b, the previous RECOMMENDED": a list, not a value
            if len(between) <= GAP and all(b in CONNECT or b.isdigit() or b.upper() in CONSTANTS for b in between):
                if toks[p][0] not in skip:
                    found.add((toks[p][0], role, press))
    return sorted(found)


def stale(found: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The statements the registry, as it is now, contradicts."""
    values = {c: getattr(registry, c) for c in CONSTANTS}
    return [s for s in found if (s[2] not in values.values() if s[1] == ANY else values[s[1]] != s[2])]


def all_statements() -> dict[Path, list[tuple[int, str, str]]]:
    return {page: statements(page) for page in PAGES}


def test_the_detector_finds_every_phrasing(monkeypatch):
    old, new = registry.RECOMMENDED, "snapkv"
    probe = "\n".join([
        f"1 `RECOMMENDED` = `{old}` here.",
        f"2 RECOMMENDED (`{old}`) keeps the widest widths.",
        f"3 | default (`RECOMMENDED`) | `{old}` | 0.665 |",
        f"4 The previous `RECOMMENDED`, `{old}`, paid KVzip's pass.",
        f"5 `{old}` (round 2's `RECOMMENDED`) did this.",
        f"6 `{old}` is the default press.",
        f'7 RECOMMENDED = "{old}"',
        f"8 We recommended `{old}` then.",
        f"9 {old} → **RECOMMENDED**",
        f"10 The recommended press, `{old}`, evicts.",
        # not statements: a press and a role far apart or joined by a content word
        f"11 `RECOMMENDED` changes only if a new design's worst exceeds `{old}`'s by more than the margin.",
        "12 `h2o` against the recommendations; see `results/archive/dev/recommended.md` and `topk_gate_widest` (Fast KVzip's).",
        f"13 [the rule](docs/research/recommendation-rule.md) about `{old}` on retrieval alone.",
    ])
    path = ROOT / "docs" / "_probe.md"
    found = statements(path, probe)
    assert {line for line, _, _ in found} == set(range(1, 11)), found
    assert not stale(found)  # true statements of the current pick
    for constant in CONSTANTS:  # the old pick leaves every role it held (RECOMMENDED may also be another's)
        if getattr(registry, constant) == old:
            monkeypatch.setattr(registry, constant, new)
    assert {line for line, _, _ in stale(statements(path, probe))} == set(range(1, 11))
    # the roles: each word maps to its constant
    roles = statements(path, "a `snapkv` for prose.\nb for retrieval: `tova`\nc `h2o` is the fast press\n")
    assert roles == [(1, "RECOMMENDED_PROSE", "snapkv"), (2, "RECOMMENDED_RETRIEVAL", "tova"),
                     (3, "RECOMMENDED_FAST", "h2o")]


def test_history_entries_are_dated_and_only_they_are_exempt():
    lines = HISTORY.read_text().split("\n")
    headings = [line for line in lines[1:] if line.startswith("## ")]
    assert headings and all(re.match(r"^## \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC: ", h) for h in headings), headings
    intro = lines[:lines.index(headings[0])]
    assert not exempt_lines(HISTORY, lines) & set(range(1, len(intro) + 1))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_statement_names_the_registrys_pick(page):
    assert not stale(statements(page)), f"{page.relative_to(ROOT)}: statements of a pick the registry no longer holds"


@pytest.mark.parametrize("constant", CONSTANTS)
def test_a_changed_pick_fails_every_statement_of_the_old_one(constant, monkeypatch):
    """The registry is changed (a copy of its constants, by monkeypatch): every statement of the old pick in
    README.md and below docs/ (the history's dated entries aside) fails, and so does the README's table."""
    from evaluation.report import recommended

    old = getattr(registry, constant)
    before = all_statements()
    assert not any(stale(found) for found in before.values())
    of_old = {(page, s) for page, found in before.items() for s in found if s[2] == old
              and (s[1] == constant or (s[1] == ANY and old not in
                                        {getattr(registry, c) for c in CONSTANTS if c != constant}))}
    assert any(page.name == "README.md" for page, _ in of_old), "the README's table states every pick"
    new = next(p for p in ("snapkv", "tova", "knorm") if p not in {getattr(registry, c) for c in CONSTANTS})
    monkeypatch.setattr(registry, constant, new)
    after = {(page, s) for page in PAGES for s in stale(statements(page))}
    assert of_old <= after, sorted(of_old - after)
    readme = (ROOT / "README.md").read_text()
    rows = [r for r in recommended.frame(recommended.rows()).to_dict("records")]
    assert any(f"`{new}`" == r["press"] for r in rows)
    assert f"`{new}`" not in (recommended.block(readme) or "")  # README == generated now fails


def test_readme_table_is_generated():
    from evaluation.report import recommended

    found = recommended.block((ROOT / "README.md").read_text())
    assert found is not None, "README.md has no generated table"
    assert found == recommended.markdown(), "run: kvprob recommended --write README.md"


COUNT = re.compile(r"\b(\d+) (prefill|decoding) presses\b")


def test_counts_of_presses_are_the_codes():
    counts = registry.counts()  # what `kvprob presses` prints
    stated = [(page.relative_to(ROOT), int(n), kind) for page in PAGES for n, kind in COUNT.findall(page.read_text())]
    assert any(str(page) == "README.md" for page, _, _ in stated)
    assert all(n == counts[kind] for _, n, kind in stated), (stated, counts)


def test_readme_and_docs_pages_carry_no_round_or_issue_numbers():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b(round|issue) [0-9]", line, re.IGNORECASE)]
    assert not found, "\n".join(found)


def test_readme_has_at_most_2000_words():
    assert len((ROOT / "README.md").read_text().split()) <= 2000
