"""The package's import graph: layers that point one way, and no cycle."""

import ast
from pathlib import Path

import d2o

SOURCE = Path(d2o.__file__).parent
# Each module may import its own layer and the layers below it, never above.
LAYERS = [
    ("d2o.errors", "d2o.budget", "d2o.options", "d2o.paths", "d2o.data", "d2o.cluster"),
    ("d2o.engine",),
    ("d2o.methods",),
    ("d2o.runtime", "d2o.models"),
    ("d2o.eval", "d2o.bench", "d2o.serve", "d2o.demo"),
    ("d2o.cli", "d2o.__main__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The d2o modules ``path`` imports, those it imports only for annotations (under
    ``TYPE_CHECKING``) included."""
    every = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            # `from d2o.methods import full` imports the module d2o.methods.full.
            names += [f"{node.module}.{alias.name}" for alias in node.names
                      if (SOURCE.parent / f"{node.module}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()]
        every.update(name for name in names if name == "d2o" or name.startswith("d2o."))
    return every


def layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


GRAPH = {module_name(path): imports(path) for path in SOURCE.rglob("*.py")}


def test_every_module_imports_only_its_layer_and_those_below():
    upward = []
    for module, every in GRAPH.items():
        if module == "d2o":  # the package's lazy public names
            continue
        for target in every:
            if target != "d2o" and layer_of(target) > layer_of(module):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_the_engine_never_imports_a_method_or_anything_above():
    engine = {m: every for m, every in GRAPH.items() if m.startswith("d2o.engine")}
    assert len(engine) >= 7
    for module, every in engine.items():
        assert not any(t.startswith(("d2o.methods", "d2o.runtime", "d2o.eval", "d2o.bench", "d2o.cli"))
                       for t in every), module


def test_methods_see_the_engine_through_its_boundary_alone():
    """A method imports ``d2o.engine.api`` and nothing else of the engine, which imports nothing
    else of the engine either (annotation-only imports count)."""
    for module, every in GRAPH.items():
        engine = {t for t in every if t.startswith("d2o.engine")}
        if module.startswith("d2o.methods"):
            assert engine <= {"d2o.engine.api"}, module
        if module == "d2o.engine.api":
            assert not engine, engine
    assert any("d2o.engine.api" in GRAPH[m] for m in GRAPH if m.startswith("d2o.methods"))


def test_the_import_graph_has_no_cycle():
    """Imports made only for annotations (under ``TYPE_CHECKING``) count: a cycle hidden there is
    one all the same."""
    graph = {module: {t for t in every if t in GRAPH and t != module} for module, every in GRAPH.items()}
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                raise AssertionError(" -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
