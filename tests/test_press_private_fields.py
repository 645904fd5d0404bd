"""The evaluation code drives presses through their public methods: it never writes a press's private field."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A transformers config's settable fields that start with an underscore (its loaders set them): not a press's.
CONFIG_FIELDS = {"_name_or_path", "_attn_implementation"}


def private_writes(source: str) -> list[tuple[int, str]]:
    """(line, text) of every assignment, augmented assignment, deletion or ``setattr`` of an underscore attribute
    of an object other than ``self`` / ``cls`` (dunders and ``CONFIG_FIELDS`` excepted)."""
    found = []

    def private(name) -> bool:
        return (isinstance(name, str) and name.startswith("_") and not name.endswith("__")
                and name not in CONFIG_FIELDS)

    def check(target, node):
        for t in ast.walk(target) if isinstance(target, (ast.Tuple, ast.List)) else [target]:
            if isinstance(t, ast.Attribute) and private(t.attr) and not (
                    isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(t)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                check(target, node)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check(node.target, node)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                check(target, node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and private(node.args[1].value)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_each_form_of_write():
    source = ("press._cache = c\npress._a, press._b = 1, 2\npress._n += 1\ndel press._x\nsetattr(press, '_t', 1)\n"
              "self._ok = 1\npress.public = 1\nx.__dict__ = {}\nmodel.config._name_or_path = 'p'\n")
    assert [line for line, _ in private_writes(source)] == [1, 2, 2, 3, 4, 5]


def test_evaluation_writes_no_private_field_of_another_object():
    hits = {f"{path.relative_to(ROOT)}:{line}: {text}" for path in sorted((ROOT / "evaluation").rglob("*.py"))
            for line, text in private_writes(path.read_text())}
    assert not hits, sorted(hits)
