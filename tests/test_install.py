"""The package as a user installs it: build the wheel, install it (no dependencies) into a fresh
folder on top of the current environment, and run its ``kvprob`` entry point from there."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a wheel built and installed: `make test-all`

SOURCES = ["kvpress_prob", "evaluation", "pyproject.toml", "README.md", "LICENSE"]


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kwargs)
    assert result.returncode == 0, f"{args}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (the build writes build/ and *.egg-info into its tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", tmp / "dist", src])
    (built,) = (tmp / "dist").glob("kvpress_prob-*.whl")
    return built


def test_wheel_holds_the_packages_license_and_typing_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvpress_prob/py.typed" in names
    assert "kvpress_prob/integrations/kvpress_eval.py" in names and "evaluation/cli.py" in names
    assert "evaluation/tasks/ruler/offline.py" in names and "evaluation/bench/__main__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert all(f"evaluation/{sub}/__init__.py" in names
               for sub in ("tasks", "tasks/ruler", "tasks/prose", "tasks/recall", "tasks/streaming", "metrics", "engine",
                           "store", "report", "bench", "gpu_check"))
    assert not any(n.startswith(("tests/", "results/", "experiments/")) for n in names)  # studies run from a checkout
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text and "Requires-Dist: kvpress==0.5.5" in text
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvprob = evaluation.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_cli_runs_help_and_a_tiny_generate(wheel, tmp_path):
    from evaluation.store.assets import MissingAssetError, require_embedded_model
    from kvpress_prob.models import EMBEDDED_NAME, embedded_model_path

    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site, wheel])
    cache = tmp_path / "cache"  # an empty RULER cache, so generate really generates
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "KVPROB_CACHE": str(cache)}
    kvprob = site / "bin" / "kvprob"

    where = run([sys.executable, "-c", "from importlib.util import find_spec; "  # where each resolves, not run
                 "print(find_spec('kvpress_prob').origin, find_spec('evaluation').origin)"],
                env=env, cwd=tmp_path).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # the installed copy, not the sources

    text = run([kvprob, "--help"], env=env, cwd=tmp_path).stdout
    assert "generate" in text and "presses" in text and "demo" in text

    try:
        require_embedded_model()
    except MissingAssetError as error:
        pytest.skip(f"the tiny generate needs the embedded model's tokenizer: {error}")
    (cache / EMBEDDED_NAME).symlink_to(embedded_model_path())  # reuse the converted model, not the RULER cache
    out = run([kvprob, "generate", "--dataset", "ruler", "--context-length", "256", "--n-examples", "2",
               "--tasks", "niah_single_1", "niah_single_2"], env=env, cwd=tmp_path).stdout
    assert "2 examples" in out and "niah_single_2" in out
    assert len(list((cache / "ruler").glob("ruler-256-2-seed0-*.jsonl"))) == 1
