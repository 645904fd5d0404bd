"""The repository's layout: results/ holds records and the commands that made them, no code; every command of
results/ names a module or file that exists; evaluation/ is packaged whole, experiments/ is not, and each study
in experiments/ runs as ``python -m experiments.<study>``."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "results").rglob("*.sh"))


def test_results_hold_no_python():
    assert not list((ROOT / "results").rglob("*.py"))


def command_lines(script: Path) -> list[str]:
    """The command lines of a shell script: continuations joined, comment lines and trailing comments dropped."""
    text = re.sub(r"\\\n", " ", script.read_text())
    return [line.split(" #")[0] for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT / "results")))
def test_every_command_of_results_names_what_exists(script):
    """Every ``-m MODULE [SUBCOMMAND]`` (also inside a variable: ``RULER="$PY -m evaluation run ..."``) names an
    importable module and, for kvprob and the bench CLI, one of their subcommands; every ``python FILE.py`` a file."""
    for line in command_lines(script):
        for module, rest in re.findall(r"(?<!\S)-m\s+([\w.]+)(?:\s+([\w-]+))?", line):
            assert importlib.util.find_spec(module), f"{script.name}: no module {module}"
            check_subcommand(script, module, [rest] if rest else [])
        for path in re.findall(r"python3?\}?\s+([\w./-]+\.py)\b", line):
            assert (ROOT / path).is_file(), f"{script.name}: no file {path}"


def check_subcommand(script: Path, module: str, rest: list[str]) -> None:
    """``python -m evaluation X`` / ``python -m evaluation.bench X``: X is one of their subcommands."""
    from evaluation.bench.__main__ import COMMANDS, OWN_PARSERS
    from evaluation.cli import parser

    if module == "evaluation" and rest:
        choices = next(a for a in parser()._actions if a.dest == "command").choices
        assert rest[0] in choices, f"{script.name}: no kvprob command {rest[0]}"
    if module == "evaluation.bench" and rest:
        assert rest[0] in {*COMMANDS, *OWN_PARSERS}, f"{script.name}: no bench {rest[0]}"


def test_evaluation_is_packaged_whole_and_experiments_is_not():
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.packages.find]", 1)[1]
    include = re.search(r"^include\s*=\s*\[(.*?)\]", section, re.M | re.S).group(1)  # no tomllib on Python 3.10
    patterns = [p.rstrip("*") for p in re.findall(r'"([^"]+)"', include)]
    assert "evaluation" in patterns
    assert not any("experiments".startswith(p) for p in patterns)
    for folder in (ROOT / "evaluation").rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and list(folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has no __init__.py"
    assert (ROOT / "experiments" / "__init__.py").is_file()


STUDIES = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__") + sorted(
    p.parent.name for p in (ROOT / "experiments").glob("*/__main__.py"))


@pytest.mark.parametrize("study", STUDIES)
def test_each_study_runs_as_a_module(study):
    module = importlib.import_module(f"experiments.{study}")
    path = Path(module.__file__)
    if path.name == "__init__.py":
        assert "main()" in (path.parent / "__main__.py").read_text()
        module = importlib.import_module(f"experiments.{study}.run")
    else:
        assert 'if __name__ == "__main__":' in path.read_text(), f"{study} does not run as a module"
    assert callable(module.main) and module.__doc__


def test_the_package_imports_no_study():
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "evaluation").rglob("*.py")
             if re.search(r"^\s*(from|import) experiments\b", p.read_text(), re.M)]
    assert not found, f"evaluation/ imports experiments/: {found}"
