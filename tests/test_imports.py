"""The project's modules import each other without cycles, and the floors keep their order.

Every ``import`` is counted: at module level, inside functions, and under
``TYPE_CHECKING`` (a circle of type-only imports is still a circle a reader must untie).
Floors, from the bottom: ``compat/`` (mlx-lm's private names), ``cache/``, ``scheduler/``, then ``gateway/``; inside the
gateway, ``gateway/http/`` is a kit (bodies, errors, SSE, hosts, middleware) that imports
nothing of the protocols, the conversation, the models or the routes, and the routes sit
above the protocols.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compat", "cache", "scheduler", "gateway")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (any import statement anywhere in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                full = f"{prefix}.{alias.name}"
                add(full if full in modules else prefix)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_and_type_checking_imports():
    graph = import_graph()
    assert "cache.budget" in graph["cache.manager"]  # from .budget import ...
    assert "gateway.models.handle" in graph["gateway.conversation.next_turn"]  # under TYPE_CHECKING


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("lower, upper", [
    ("compat", ("cache", "scheduler", "gateway")),
    ("cache", ("scheduler", "gateway")),
    ("scheduler", ("gateway",)),
    ("gateway.http", ("gateway.protocols", "gateway.conversation", "gateway.models", "gateway.routes",
                      "gateway.server")),
    ("gateway.conversation", ("gateway.protocols", "gateway.routes", "gateway.server")),
    ("gateway.protocols", ("gateway.routes", "gateway.server")),
    ("gateway.models", ("gateway.conversation", "gateway.protocols", "gateway.routes", "gateway.server")),
])
def test_floors_import_only_downwards(lower, upper):
    graph = import_graph()
    up = [(m, t) for m, targets in graph.items() if m == lower or m.startswith(lower + ".")
          for t in targets if any(t == u or t.startswith(u + ".") for u in upper)]
    assert up == [], f"{lower} imports from above it: {up}"
