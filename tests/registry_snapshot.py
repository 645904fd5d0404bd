"""The registry's presses as plain data, to check that a rewritten registry builds the same presses.

``tree(obj)`` is a dataclass as ``{"class": module.Name, "fields": {name: tree(value)}}`` over its init
fields (the settings; run state such as ``stats`` is left out), recursively; anything else is its
``repr``. Run as a script, it writes ``tests/data/registry-<commit>.json``: for every name of
``PRESSES``, the tree of ``get_press(name, r)`` at r = 0.25 and 0.5. The committed file was written
once from main at commit a1ed234 (the registry typed name by name):

    PYTHONPATH=$PWD python tests/registry_snapshot.py a1ed234
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

RATIOS = (0.25, 0.5)
DATA = Path(__file__).resolve().parent / "data"


def tree(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {"class": f"{cls.__module__}.{cls.__qualname__}",
                "fields": {f.name: tree(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}}
    if isinstance(obj, (list, tuple)):
        return [tree(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): tree(v) for k, v in obj.items()}
    return repr(obj)


def snapshot() -> dict:
    from kvpress_prob.names.registry import PRESSES, get_press

    return {name: {str(r): tree(get_press(name, r)) for r in RATIOS} for name in PRESSES}


if __name__ == "__main__":
    commit = sys.argv[1]
    path = DATA / f"registry-{commit}.json"
    path.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"{path}: {len(json.loads(path.read_text()))} presses")
