"""replaybuf's architecture, checked from its source: imports flow downhill between layers, no
import circle (imports inside functions included), a pure core, short modules.

The layers, bottom to top (a module may import its own layer and the layers below)::

    errors, args  ->  core  ->  accel  ->  storage  ->  priority  ->  episodes  ->  sampling
    ->  persist  ->  buffers  ->  integrations, collecting, cli, the package itself
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "replaybuf"
LAYERS = [
    ("errors", "args"),
    ("core",),
    ("accel",),
    ("storage",),
    ("priority",),
    ("episodes",),
    ("sampling",),
    ("persist",),
    ("buffers",),
    ("integrations", "compat", "collecting", "cli", "__main__", ""),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MAX_LINES = 500
# What the pure core may import besides itself: the standard library, torch and numpy.
CORE_ALLOWED = {"torch", "numpy", "math", "functools", "typing", "__future__", "collections"}


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (any depth, except under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def replaybuf_target(imported: str) -> str | None:
    """The replaybuf module an import names (a name imported from a module maps to it)."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = {replaybuf_target(i) for i in imports_of(name, path)}
        # A module's own packages run first anyway (Python imports parents first).
        edges[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return edges


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in edges:
        if v not in index:
            visit(v)
    return found


def uphill(edges: dict[str, set[str]]) -> list[str]:
    """The imports of a layer above the importing module's."""
    return [
        f"{name} ({layer(name) or 'replaybuf'}) imports {target} ({layer(target)})"
        for name, targets in edges.items()
        for target in targets
        if RANK[layer(target)] > RANK[layer(name)]
    ]


def test_the_checks_see_what_they_must() -> None:
    """The checker itself: an import inside a function counts (cli imports collect only in
    a function), one under TYPE_CHECKING does not, and a circle or an uphill import shows."""
    edges = graph()
    assert "replaybuf.collecting" in edges["replaybuf.cli"]
    assert "replaybuf.buffers.episodes" not in edges["replaybuf.buffers.episode_state"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert uphill({"replaybuf.storage.slots": {"replaybuf.episodes.core"}}) != []
    assert uphill({"replaybuf.episodes.core": {"replaybuf.storage.slots"}}) == []


def test_no_import_circle() -> None:
    assert cycles(graph()) == []


def test_imports_flow_downhill_between_layers() -> None:
    assert uphill(graph()) == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n) == "core"))
def test_the_core_is_pure(name: str) -> None:
    """The core imports torch, numpy and the standard library, and nothing of replaybuf but
    itself and the error classes (the layer below it, which imports nothing): never torchrl,
    tensordict or asyncio."""
    imported = {i.split(".")[0] for i in imports_of(name, MODULES[name])}
    outside = {
        i
        for i in imports_of(name, MODULES[name])
        if replaybuf_target(i) and layer(i) not in ("core", "errors")
    }
    assert outside == set()
    assert imported <= CORE_ALLOWED | {"replaybuf"}, imported - CORE_ALLOWED


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT.parent)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
