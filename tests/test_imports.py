"""No import circles in ``evaluation/`` and ``kvpress_prob/``, counting imports inside functions too
(an import moved into a function hides a circle from Python, not from a reader).

The graph is read with ``ast`` from every module's source: ``import a.b`` and ``from a import b`` (an
edge to the module ``a.b`` when it is one, else to ``a``), relative imports resolved, at any depth of
the file. Skipped: imports of other packages, and imports by computed name (``importlib.import_module``
with an f-string, as ``evaluation/bench/__main__.py`` dispatches its benches).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("evaluation", "experiments", "kvpress_prob")


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (a package is its ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of an attribute path: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    colour, stack = {}, []

    def visit(node):
        colour[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour and (cycle := visit(nxt)):
                return cycle
        colour[node] = "black"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in colour and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_sees_imports_inside_functions():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"] and find_cycle({"a": {"b"}, "b": set()}) is None
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert "evaluation.engine.runner" in graph["evaluation.cli"]  # imported inside cmd_run only
    assert "evaluation.tasks.ruler.text" in graph["evaluation.tasks.ruler.words"]


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, ("import circle: " + " -> ".join(cycle)
                           + "; move the names both modules need into a module both import")
