"""README.md, every page below docs/ (docs/**/*.md) and results/README.md against the repository: every command parses, every path and test exists.

What is read:
- command lines: the lines of ```bash / ```sh / ```shell blocks (a trailing backslash continues a line,
  ``#`` starts a comment) and inline code spans that start with ``kvprob`` or ``python -m``;
- paths: tokens of those commands and of inline code spans, and relative link targets, that start
  with a top-level folder of the repository (``results/``, ``tests/``, ``docs/``, ``evaluation/``,
  ``experiments/``, ``kvpress_prob/``, any other) or name a top-level file; ``tests/x.py::name`` also needs ``def name`` in x.py.

Checks:
- Every link to a heading (``page.md#anchor``, ``#anchor``) names a heading of that page.
- ``kvprob ...`` / ``python -m evaluation ...`` parse with ``evaluation.cli.parser()``, ``kvprob bench`` /
  ``python -m evaluation.bench ...`` with the bench CLI's parsers (parse only: nothing is run);
  ``python -m pytest`` names existing test files; any other ``python -m x`` names an importable module.
- An inline span without an option (``kvprob merge``, ``python -m evaluation.bench fidelity``) names a
  command: only its (sub)command is checked. So is a command holding a placeholder (``<out>``, ``...``).
- Every path exists, except: outputs (``--out`` values, and anything under the ``--out`` of an earlier
  command of the same file, e.g. a run's folder that the next command reports on), git-ignored outputs
  (``results/demo/``), and tokens with shell syntax (``$OUT``, ``*``, ``{a,b}``) or placeholders.

Skipped: lines of other programs (``pip install``, ``make``, ``sbatch``, ``huggingface-cli``, ``cd``) are
not parsed, only their path tokens checked; paths relative to a package (``samplers/poisson.py``).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "results" / "README.md"]
# every top-level folder of the repository (results/, tests/, docs/, evaluation/, experiments/, kvpress_prob/, ...)
TOP = tuple(sorted(f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                   and p.name not in ("build", "dist") and not p.name.endswith(".egg-info")))
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "LICENSE")
IGNORED = ("results/demo",)  # git-ignored outputs of `make demo`
FENCE = re.compile(r"^```(\w*)\s*$")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def placeholder(token: str) -> bool:
    return any(c in token for c in "$*{}<>") or "..." in token or token.isupper()


def scan(path: Path) -> tuple[list[tuple[int, str, bool]], list[tuple[int, str, bool]]]:
    """(commands, path tokens) of a markdown file: (line, text, from a fenced block) and (line, token, is a link)."""
    lines = path.read_text().splitlines()
    commands, prose, fence, start, pending = [], [], None, 0, ""
    for i, line in enumerate(lines, 1):
        match = FENCE.match(line.strip())
        if match:
            fence = None if fence is not None else match.group(1)
            prose.append("")
            continue
        if fence is None:
            prose.append(line)
            continue
        prose.append("")
        if fence not in ("bash", "sh", "shell"):
            continue
        text = line.strip()
        if not pending:
            start = i
            if text.startswith("#"):
                continue
        text = re.sub(r"\s#.*$", "", text).strip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        commands.append((start, pending + text, True))
        pending = ""
    text = "\n".join(prose)
    tokens = []
    for match in SPAN.finditer(text):
        if "\n\n" in match.group(2):
            continue
        line = text.count("\n", 0, match.start()) + 1
        span = " ".join(match.group(2).split())
        if span.startswith(("kvprob", "python -m ")):
            commands.append((line, span, False))
        else:
            tokens += [(line, t, False) for t in span.split()]
    for match in LINK.finditer(text):
        tokens.append((text.count("\n", 0, match.start()) + 1, match.group(1), True))
    return commands, tokens


def parse(argv: list[str], parser) -> str | None:
    """None if ``parser`` accepts argv, else argparse's message (``--help`` exits 0 and is accepted)."""
    err = StringIO()
    try:
        with redirect_stdout(StringIO()), redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as exit:
        return None if exit.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def bench_parser(name: str):
    from evaluation.bench.__main__ import OWN_PARSERS, build_parser

    if name in OWN_PARSERS:
        return importlib.import_module(OWN_PARSERS[name]).parser(), True
    return build_parser(), False


def check_command(words: list[str], full: bool) -> str | None:
    """An error message for a kvprob / python -m command line, or None. ``full``: parse every argument."""
    from evaluation.cli import parser as kvprob_parser

    if words[:1] == ["kvprob"]:
        module, args = "evaluation", words[1:]
    elif words[:2] == ["python", "-m"] and len(words) > 2:
        module, args = words[2], words[3:]
    else:
        return None
    if module == "evaluation" and args[:1] == ["bench"]:
        module, args = "evaluation.bench", args[1:]
    if module == "evaluation":
        if not args:
            return None  # the program's name
        return parse(args if full else args[:1] + (["--help"] if args[0] != "--help" else []), kvprob_parser())
    if module == "evaluation.bench":
        if not args or placeholder(args[0]):
            return None
        bench, own = bench_parser(args[0])
        if own:
            return parse(args[1:] if full else ["--help"], bench)
        return parse(args if full else [args[0], "--help"], bench)
    if module == "pytest":
        files = [a.split("::")[0] for a in args if not a.startswith("-")]
        missing = [f for f in files if not (ROOT / f).is_file()]
        return f"no test file {missing}" if missing else None
    if placeholder(module):  # python -m experiments.<study>
        return None
    return None if importlib.util.find_spec(module) else f"no module {module}"


def outputs(words: list[str]) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--out"]


def check_path(token: str, base: Path, written: list[str]) -> str | None:
    """An error message if ``token`` names a repository path that does not exist (None if fine or not a path)."""
    token = token.strip(".,;:()'\"").split("#")[0]
    test = None
    if "::" in token:
        token, test = token.split("::", 1)
    if not token.startswith(TOP) and token not in TOP_FILES:
        return None
    if placeholder(token) or token.startswith(IGNORED):
        return None
    if any(token.rstrip("/") == w.rstrip("/") or token.startswith(w.rstrip("/") + "/") for w in written):
        return None
    path = base / token
    if not path.exists():
        return f"{token} does not exist"
    if test and not re.search(rf"^\s*def {re.escape(test.split('[')[0])}\(", path.read_text(), re.M):
        return f"{token} has no test {test}"
    return None


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def check_anchor(link: str, doc: Path) -> str | None:
    """An error message if a link's ``#anchor`` names no heading of the markdown file it points to."""
    target, _, anchor = link.partition("#")
    path = (doc.parent / target).resolve() if target else doc
    if not anchor or path.suffix != ".md" or not path.is_file() or anchor in anchors(path):
        return None
    return f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}"


def problems(doc: Path) -> list[str]:
    commands, tokens = scan(doc)
    rel, found, written = doc.relative_to(ROOT), [], []
    for line, text, fenced in sorted(commands):
        try:
            words = shlex.split(text)
        except ValueError as error:
            found.append(f"{rel}:{line}: cannot split `{text}`: {error}")
            continue
        full = (fenced or any(w.startswith("-") for w in words[2:])) and not any(placeholder(w) for w in words)
        if (message := check_command(words, full)) is not None:
            found.append(f"{rel}:{line}: `{text}`: {message}")
        out = outputs(words)
        for word in words:
            if word not in out and (message := check_path(word, ROOT, written)):
                found.append(f"{rel}:{line}: `{text}`: {message}")
        written += out
    for line, token, link in tokens:
        if link and token.startswith(("http://", "https://", "mailto:")):
            continue
        if link and (message := check_anchor(token, doc)):
            found.append(f"{rel}:{line}: {message}")
        if link and token.startswith("#"):
            continue
        base = doc.parent if link else ROOT
        if link:
            token = str((doc.parent / token.split("#")[0]).resolve().relative_to(ROOT)) if token.split("#")[0] else ""
            base = ROOT
        if token and (message := check_path(token, base, written)):
            found.append(f"{rel}:{line}: {message}")
    return found


def test_the_checker_finds_what_it_should(tmp_path, monkeypatch):
    doc = ROOT / "docs" / "_probe.md"
    text = ("x\n```bash\nkvprob run --presses snapkv \\\n    --out results/new-run   # comment\n"
            "kvprob report --results results/new-run\nkvprob run --presses snapkv --ratios 2 --out x\n```\n"
            "See `tests/test_nope.py` and `tests/test_docs.py::test_missing`, `kvprob merge` and\n"
            "`kvprob compare --results results/never-run\n--split test` and [a](../results/gone/).\n"
            "[b](../README.md#no-such-heading), [c](../README.md#quickstart)\n"
            "`python -m experiments.nope`, `python -m experiments.<study>` in `experiments/nope.py`\n")
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if self == doc else Path.read_bytes(self).decode())
    found = problems(doc)
    assert any(f.startswith("docs/_probe.md:6: `kvprob run --presses snapkv --ratios 2") for f in found), found
    assert "docs/_probe.md:8: tests/test_nope.py does not exist" in found
    assert "docs/_probe.md:8: tests/test_docs.py has no test test_missing" in found
    assert any(f.startswith("docs/_probe.md:9: `kvprob compare") and "results/never-run does not exist" in f
               for f in found), found
    assert "docs/_probe.md:10: results/gone does not exist" in found
    assert "docs/_probe.md:11: ../README.md#no-such-heading: no heading #no-such-heading in README.md" in found
    assert "docs/_probe.md:12: `python -m experiments.nope`: no module experiments.nope" in found
    assert "docs/_probe.md:12: experiments/nope.py does not exist" in found  # any top-level folder is checked
    assert "experiments/" in TOP and "evaluation/" in TOP
    assert len(found) == 8, found  # the run's --out folder, reported on next, `kvprob merge` and <study> are fine


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_commands_paths_and_tests_exist(doc):
    found = problems(doc)
    assert not found, "\n".join(found)


def test_every_page_below_docs_is_checked():
    pages = {p for p in (ROOT / "docs").rglob("*.md")}
    assert pages <= set(DOCS) and any(p.parent != ROOT / "docs" for p in pages)  # the research folder too


def test_every_page_below_docs_is_linked_from_the_front_door_or_a_page():
    """No orphan page: each page below docs/ is linked from README.md or another page."""
    linked = set()
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            path = (doc.parent / target.split("#")[0]).resolve()
            if target.split("#")[0] and not target.startswith(("http://", "https://")):
                linked.add(path)
    orphans = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if p.resolve() not in linked]
    assert not orphans, orphans


def test_catalogue_links_name_headings_of_docs_presses():
    """`kvprob presses` points each family at a section of docs/presses.md: that heading exists."""
    from kvpress_prob.names.catalogue import FAMILIES

    for family in FAMILIES.values():
        assert check_anchor(family.docs.removeprefix("docs/"), ROOT / "docs" / "index.md") is None, family.docs


def test_every_picture_of_the_measurements_page_exists_with_its_record_and_command(tmp_path):
    """docs/measurements.md: each picture it shows is a committed PNG, named under it by the records it is drawn
    from (which exist) and by ``python -m experiments.measurements NAME``, the command that writes that file; one
    command is rerun here and writes a PNG of the same name."""
    from experiments import measurements

    page = ROOT / "docs" / "measurements.md"
    sections = page.read_text().split("\n## ")[1:]
    assert len(sections) >= 4
    names = {}
    for section in sections:
        (image,) = re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", section)
        png = page.parent / image
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{image} is no committed PNG"
        records = re.findall(r"`(results/[^`\s]+)`", section.split("Records:", 1)[1].split("Command:", 1)[0])
        assert records and all((ROOT / r).exists() for r in records), f"{image}: records {records}"
        (name,) = re.findall(r"Command: `python -m experiments\.measurements (\w+)`", section)
        assert name in measurements.PICTURES, f"{image}: no picture {name!r} in experiments/measurements.py"
        names[name] = png.name
    assert set(names) == set(measurements.PICTURES)
    for path in (measurements.TABLE, measurements.BUDGET, measurements.FIDELITY / "records.jsonl",
                 *(ROOT / p for p in measurements.DECODE_RECORDS)):
        assert path.exists(), f"experiments/measurements.py reads {path}, which does not exist"
    (written,) = measurements.main(["budget", "--out", str(tmp_path)])
    assert written.name == names["budget"] and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
