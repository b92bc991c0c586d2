"""The package's import arrows point one way (docs/architecture.md):

    api -> compiler -> core <- runtime;  tools -> api, runtime, compiler, core, zoo;  zoo -> nothing.

Read with ``ast`` (function-local imports included), so a cycle hidden inside a function fails too.
"""
import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "alpa_lite"
# layer -> layers it may import (besides itself)
ALLOWED = {
    "core": set(),
    "compiler": {"core"},
    "runtime": {"core"},
    "tools": {"core", "compiler", "runtime", "api", "zoo"},
    "zoo": set(),
    "api": {"core", "compiler", "runtime"},
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported module, imported names) for every import of an alpa_lite module in ``path``."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("alpa_lite"):
                    yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("alpa_lite"):
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if (PACKAGE.parent / (target + "." + n).replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / (target + "." + n).replace(".", "/") / "__init__.py").exists()]
            for n in submodules:
                yield f"{target}.{n}", []
            yield target, [n for n in names if n not in submodules]


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        src = _module(path)
        g.add_node(src)
        for target, names in _imports(path):
            g.add_edge(src, target, names=names)
    return g


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None
    return parts[1] if parts[1] in ALLOWED else None


def test_no_import_cycle():
    g = _graph()
    # a package's __init__ re-exporting its own submodules is not a cycle of the code
    code = g.edge_subgraph([(a, b) for a, b in g.edges if not (b != a and a.startswith(b + "."))])
    cycles = [sorted(c) for c in nx.strongly_connected_components(code) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_layers_import_only_downwards():
    bad = []
    for a, b in _graph().edges:
        la, lb = _layer(a), _layer(b)
        if la is None or la == lb:
            continue
        if lb is None and b != "alpa_lite":  # top-level modules: cli, train
            bad.append(f"{a} -> {b} (the layers may not import the command line)")
        elif lb is not None and lb not in ALLOWED[la]:
            bad.append(f"{a} -> {b}")
        elif b == "alpa_lite":
            bad.append(f"{a} -> alpa_lite (import the module, not the package's re-exports)")
    assert not bad, "imports against the layer arrows:\n" + "\n".join(bad)


def _private_attribute_uses(path: Path):
    """``mod._name`` where ``mod`` is an alpa_lite module imported as a name (``from . import planner``)."""
    tree = ast.parse(path.read_text())
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("alpa_lite")):
            for target, _ in _imports(path):
                for a in node.names:
                    if target.endswith("." + a.name):
                        modules[a.asname or a.name] = target
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield f"{_module(path)} uses {modules[node.value.id]}.{node.attr}"


def test_no_private_names_across_modules():
    bad = [f"{a} imports {n} from {b}" for a, b, d in _graph().edges(data=True)
           for n in d["names"] if n.startswith("_") and a != b]
    bad += [use for path in PACKAGE.rglob("*.py") for use in _private_attribute_uses(path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_exists(layer):
    assert (PACKAGE / f"{layer}.py").exists() or (PACKAGE / layer / "__init__.py").exists()
