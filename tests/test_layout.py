"""The repository's layout: results/ holds records and the commands that made them, no code; every command of
results/ names a module or file that exists; evaluation/ is packaged whole, experiments/ is not, and each study
in experiments/ runs as ``python -m experiments.<study>``."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "results").rglob("*.sh"))


def test_results_hold_no_python():
    assert not list((ROOT / "results").rglob("*.py"))


def commands(script: Path) -> list[list[str]]:
    """The words of each command line of a shell script (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", script.read_text())
    found = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            try:
                found.append(shlex.split(line))
            except ValueError:  # a quote spanning lines: a shell construct the check leaves alone
                continue
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT / "results")))
def test_every_command_of_results_names_what_exists(script):
    for words in commands(script):
        for i, word in enumerate(words[:-1]):
            word = word.strip("\"'")
            if word.endswith("python") or word.endswith("python3") or word == "$PY":
                target = words[i + 1]
                if target == "-m":
                    module = words[i + 2].strip("\"'")
                    assert importlib.util.find_spec(module), f"{script.name}: no module {module}"
                elif target.endswith(".py"):
                    assert (ROOT / target).is_file(), f"{script.name}: no file {target}"
        for word in words:  # "python -m x" held in a variable: RULER="$PY -m evaluation run ..."
            for module in re.findall(r"-m ([\w.]+)", word):
                assert importlib.util.find_spec(module), f"{script.name}: no module {module}"


def test_evaluation_is_packaged_whole_and_experiments_is_not():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    patterns = [p.rstrip("*") for p in find["include"]]
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
