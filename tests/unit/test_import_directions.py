"""Imports run one way: no circles, and the relay core knows nothing of the Django side.

Read from the source with `ast` (every import, also those inside functions), so a lazy
import that closes a circle is caught as surely as one at the top of a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "outbox_notify"

# The relay core: everything under relay/ but runner, which builds a relay from Django
# settings (the relay's Django face, as the management commands are the library's).
RELAY_FACE = "outbox_notify.relay.runner"
# What the relay core may never import: Django, and this library's Django side and operator
# code. Reports leave the relay through its own Protocols (relay/reporting.py).
DJANGO_SIDE = (
    "django",
    "outbox_notify.conf",
    "outbox_notify.signals",
    "outbox_notify.observability",
    "outbox_notify.models",
    "outbox_notify.admin",
    "outbox_notify.apps",
    "outbox_notify.app",
    "outbox_notify.checks",
    "outbox_notify.wiring",
    "outbox_notify.management",
    "outbox_notify.events",
    "outbox_notify.testing",
    "outbox_notify.pytest_plugin",
    "outbox_notify._write",
    RELAY_FACE,
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: set[str]) -> Iterator[str]:
    """Every module, of this package or outside it, that the file at `path` imports."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in known else node.module


def graph() -> dict[str, set[str]]:
    """module -> the modules of this package it imports (the package's face left out)."""
    found = modules()
    known = set(found)
    edges: dict[str, set[str]] = {}
    for name, path in found.items():
        targets = {
            t for t in imported(path, known) if t in known and t not in {name, "outbox_notify"}
        }
        edges[name] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def relay_core() -> list[str]:
    return [m for m in modules() if within(m, "outbox_notify.relay") and m != RELAY_FACE]


def test_no_module_imports_itself_through_others() -> None:
    """No circle of imports between the package's modules, lazy imports included."""
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    """The finder itself can fail: a two-module loop is reported."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_relay_core_imports_nothing_of_the_django_side() -> None:
    """relay/ (runner aside) imports neither Django nor the library's Django side or commands."""
    known = set(modules())
    wrong = {
        f"{name} -> {target}"
        for name in relay_core()
        for target in imported(modules()[name], known)
        if any(within(target, side) for side in DJANGO_SIDE)
    }
    assert sorted(wrong) == []


def test_nothing_below_the_relay_reaches_back_into_it() -> None:
    """What the relay core imports from the rest of the package never imports the relay."""
    edges = graph()
    core = set(relay_core())
    outside = {t for m in core for t in edges[m] if t not in core}
    back = {f"{m} -> {t}" for m in outside for t in edges[m] if within(t, "outbox_notify.relay")}
    assert sorted(back) == []


def test_the_write_side_and_the_relay_share_no_module_of_either() -> None:
    """_write/ never imports the relay, and the relay never imports _write/."""
    edges = graph()
    crossing = {
        f"{m} -> {t}"
        for m, targets in edges.items()
        for t in targets
        if (within(m, "outbox_notify._write") and within(t, "outbox_notify.relay"))
        or (within(m, "outbox_notify.relay") and within(t, "outbox_notify._write"))
    }
    assert sorted(crossing) == []
