"""No import cycles in ``src/vramledger``: between modules, and between its packages.

Data flows one way (specs → engines → ledger → renderers), so the graph of who imports whom must have no
cycle. The imports are read from the source with ``ast`` (every ``import``, at the top or inside a function,
``TYPE_CHECKING`` blocks included), not by importing anything. ``from a.b import c`` depends on the module
``a.b.c`` when that is a module, else on ``a.b``. A module's package is its first name under ``vramledger``
(``vramledger.analytic.step`` → ``analytic``; ``vramledger.ledger`` → ``ledger``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "vramledger"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The vramledger modules ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for t in targets:
            while t and t not in known:  # ``import a.b.c`` where c is an attribute
                t = t.rpartition(".")[0]
            if t.startswith(ROOT) and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        a = _package(src)
        out.setdefault(a, set()).update(_package(d) for d in dsts if _package(d) != a)
    return out


def test_the_reader_sees_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    """A hand-made module: a top import, one inside a function, a relative one, a ``from package import module``."""
    src = tmp_path / "m.py"
    src.write_text(
        "from vramledger.ledger import Phase\n"
        "def f():\n    from vramledger.analytic import step\n    import vramledger.units\n"
        "from .params import layer_linears\n"
    )
    known = {
        "vramledger.ledger",
        "vramledger.analytic",
        "vramledger.analytic.step",
        "vramledger.units",
        "vramledger.analytic.params",
        "vramledger.analytic.m",
    }
    got = _imports("vramledger.analytic.m", src, known)
    print("expected 4 modules, got", sorted(got))
    assert got == {"vramledger.ledger", "vramledger.analytic.step", "vramledger.units", "vramledger.analytic.params"}


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_covers_the_package() -> None:
    graph = _graph()
    assert "vramledger.analytic.step" in graph and "vramledger.ledger" in graph["vramledger.analytic.step"]
    assert len(graph) > 50


def test_no_import_cycle_between_modules() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other: " + "; ".join(" ↔ ".join(c) for c in cycles)


def test_no_import_cycle_between_packages() -> None:
    cycles = _cycles(_package_graph(_graph()))
    assert not cycles, "packages that import each other: " + "; ".join(" ↔ ".join(c) for c in cycles)


@pytest.mark.parametrize("forbidden", ["analytic", "trace"])
def test_the_allocator_imports_neither_engine(forbidden: str) -> None:
    """allocator/ is the model of PyTorch's caching allocator that both engines use: it depends on neither."""
    graph = _graph()
    bad = sorted(
        f"{m} → {d}"
        for m, deps in graph.items()
        if _package(m) == "allocator"
        for d in deps
        if _package(d) == forbidden
    )
    assert not bad, bad
