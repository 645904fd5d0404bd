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


#: The packages, bottom up: ``kvpress_prob`` imports neither other one, ``evaluation`` does not import the studies.
PACKAGE_ORDER = ("kvpress_prob", "evaluation", "experiments")

#: kvpress_prob's folders (and top-level modules) by level, bottom up: a module imports only from its own folder
#: or a folder of a lower level; two folders of one level import nothing from each other. ``testing`` (the
#: float64 reference) sits at the bottom: it imports none of the code it checks.
LAYERS = {"models": 0, "attention_functions": 0, "proposals": 0, "testing": 0,
          "correction": 1, "samplers": 1,
          "cache": 2,
          "presses": 3,
          "decoding": 4, "learned": 4,
          "names": 5,
          "integrations": 6}

#: evaluation's folders (and top-level modules) by level, bottom up, as LAYERS: the store and the metrics at the
#: bottom, the engine above them, then the report, the tasks, the benchmarks and the arguments, the GPU check,
#: the command line and ``python -m evaluation``.
EVALUATION_LAYERS = {"store": 0, "metrics": 0, "presets": 0,
                     "engine": 1,
                     "report": 2,
                     "tasks": 3,
                     "bench": 4, "arguments": 4,
                     "gpu_check": 5,
                     "cli": 6,
                     "__main__": 7}

#: Imports that run back up today, each to be removed: the survival metric reads the engine's ``Prefill``
#: (``evaluation/metrics/survival.py``); once it reads the cache through ``kvpress_prob.cache``, delete the pair.
KNOWN_UPWARD = {"evaluation.metrics.survival -> evaluation.engine"}


def layer_of(name: str) -> str:
    """The folder (or top-level module) of a package's module; the package itself (its public API) is "api"."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "api"


def upward(graph: dict[str, set[str]], package: str = "kvpress_prob", layers: dict | None = None) -> list[str]:
    """Every import of ``graph`` within ``package`` between two of its folders that does not run down a level
    (``layers``: LAYERS for kvpress_prob), or that runs into the package's API, which sits above every folder."""
    layers = LAYERS if layers is None else layers
    rank = {**layers, "api": max(layers.values()) + 1}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a.split(".")[0] == package for b in targets
                  if b.split(".")[0] == package and layer_of(a) != layer_of(b) and rank[layer_of(b)] >= rank[layer_of(a)])


def package_graph(package: str) -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items() if name.split(".")[0] == package}


def kvpress_prob_graph() -> dict[str, set[str]]:
    return package_graph("kvpress_prob")


def test_the_layer_check_sees_an_upward_import():
    assert upward({"kvpress_prob.samplers.base": {"kvpress_prob.names.grid"}}) == [
        "kvpress_prob.samplers.base -> kvpress_prob.names.grid"]
    assert upward({"kvpress_prob.presses.h2o": {"kvpress_prob.correction.bias"}}) == []
    assert upward({"kvpress_prob.proposals.base": {"kvpress_prob"}}) == ["kvpress_prob.proposals.base -> kvpress_prob"]
    assert upward({"kvpress_prob.samplers.base": {"kvpress_prob.correction.bias"}}) == [  # one level: no arrow
        "kvpress_prob.samplers.base -> kvpress_prob.correction.bias"]
    assert upward({"kvpress_prob.samplers.base": {"kvpress_prob.samplers.topk"}}) == []  # within a folder
    assert upward({"evaluation.metrics.survival": {"evaluation.engine"}}, "evaluation", EVALUATION_LAYERS) == [
        "evaluation.metrics.survival -> evaluation.engine"]
    assert upward({"evaluation.cli": {"evaluation.engine.runner"}}, "evaluation", EVALUATION_LAYERS) == []


def test_no_import_runs_up_a_layer_in_kvpress_prob():
    graph = kvpress_prob_graph()
    assert set(map(layer_of, graph)) == set(LAYERS) | {"api"}, "a folder of kvpress_prob is missing from LAYERS"
    assert upward(graph) == []


def test_no_import_runs_up_a_layer_in_evaluation():
    graph = package_graph("evaluation")
    assert set(map(layer_of, graph)) == set(EVALUATION_LAYERS) | {"api"}, (
        "a folder of evaluation is missing from EVALUATION_LAYERS")
    found = upward(graph, "evaluation", EVALUATION_LAYERS)
    assert set(found) - KNOWN_UPWARD == set(), "imports running back up: " + ", ".join(sorted(set(found) - KNOWN_UPWARD))
    assert KNOWN_UPWARD <= set(found), f"no longer found, remove from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - set(found))}"


def test_no_package_imports_one_above_it():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    rank = {package: i for i, package in enumerate(PACKAGE_ORDER)}
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if rank[b.split(".")[0]] > rank[a.split(".")[0]])
    assert up == []


def test_the_package_layout():
    """At most 6 modules at the package's top level, no module over 450 lines, and each layer's ``__init__``
    says in one line what the layer does (a layer that is one module, ``models``, ``attention_functions``, has none)."""
    package = ROOT / "kvpress_prob"
    assert len(list(package.glob("*.py"))) <= 6
    long = {str(p.relative_to(ROOT)): n for p in package.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
    for layer in {layer for layer in LAYERS if not (package / f"{layer}.py").exists()}:  # the layers that are folders
        doc = ast.get_docstring(ast.parse((package / layer / "__init__.py").read_text()))
        assert doc and "\n" not in doc.strip(), layer


def test_the_public_api_is_one_import():
    import kvpress_prob
    from kvpress_prob import (  # noqa: F401  the line the README's quickstart documents
        PRESSES,
        RECOMMENDED,
        SamplingDecodingPress,
        SamplingPress,
        get_decoding_press,
        get_press,
        load_model,
    )

    assert set(kvpress_prob.__all__) >= {"get_press", "get_decoding_press", "load_model", "RECOMMENDED", "PRESSES",
                                         "SamplingPress", "SamplingDecodingPress", "RECOMMENDED_PROSE",
                                         "RECOMMENDED_RETRIEVAL"}
    assert all(hasattr(kvpress_prob, name) for name in kvpress_prob.__all__)
    assert RECOMMENDED in PRESSES and isinstance(get_press(RECOMMENDED, 0.5), object)
