"""The package map (docs/concepts.md) and the module table (docs/reference.md) match the code."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_import_directions import graph, modules, within

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROOT_PACKAGE = "outbox_notify"


def section(page: str, heading: str) -> str:
    """The text of a Markdown section, from its heading to the next heading of its level."""
    text = (DOCS / page).read_text(encoding="utf-8")
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    following = re.search(rf"^{level} ", text[start + len(heading) :], re.MULTILINE)
    end = start + len(heading) + following.start() if following else len(text)
    return text[start:end]


def dotted(name: str) -> str:
    """`relay/loop` -> outbox_notify.relay.loop; `__init__` -> outbox_notify; a folder keeps its /."""
    if name == "__init__":
        return ROOT_PACKAGE
    return f"{ROOT_PACKAGE}.{name.rstrip('/').replace('/', '.')}" + (
        "/" if name.endswith("/") else ""
    )


def map_layers() -> dict[str, int]:
    """Each name of the map (a module, or a folder ending in /) -> its layer's number."""
    layers: dict[str, int] = {}
    layer = 0
    for line in section("concepts.md", "## The package at a glance").splitlines():
        heading = re.match(r"^\*\*(\d+)\. ", line)
        if heading:
            layer = int(heading.group(1))
        elif line.startswith("- `"):
            names = line[2:].split(":", 1)[0]
            for name in re.findall(r"`([^`]+)`", names):
                assert name not in layers, f"{name} is on the map twice"
                layers[dotted(name)] = layer
    return layers


def mapped() -> dict[str, int]:
    """Each module of the package this check covers -> the layer the map puts it on."""
    layers = map_layers()
    placed: dict[str, int] = {}
    for module in modules():
        if module != ROOT_PACKAGE and modules()[module].name == "__init__.py":
            continue  # a sub-package's face: its modules are on the map
        for name, layer in layers.items():
            if module == name or (name.endswith("/") and within(module, name[:-1])):
                placed[module] = layer
    return placed


def test_the_map_names_only_modules_that_exist() -> None:
    """Every name on the map is a module or a folder of the package."""
    known = set(modules())
    missing = [name for name in map_layers() if name.rstrip("/") not in known]
    assert missing == []


def test_every_module_is_on_the_map() -> None:
    """Every module of the package (a sub-package's __init__ aside) stands on one layer."""
    faces = {m for m, path in modules().items() if m != ROOT_PACKAGE and path.name == "__init__.py"}
    assert sorted(set(modules()) - faces - set(mapped())) == []


def test_imports_run_down_the_map() -> None:
    """No module imports a module of a higher layer than its own."""
    placed = mapped()
    upward = [
        f"{source} ({placed[source]}) -> {target} ({placed[target]})"
        for source, targets in graph().items()
        for target in sorted(targets)
        if source in placed and target in placed and placed[target] > placed[source]
    ]
    assert upward == []


def reference_modules() -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", section("reference.md", "## Modules"), re.MULTILINE)


def is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def test_the_reference_lists_exactly_the_public_modules() -> None:
    """docs/reference.md's module table: every public module, under its own row or its package's."""
    listed = reference_modules()
    public = {m for m in modules() if is_public(m)}
    assert [m for m in listed if m not in public] == []
    uncovered = [m for m in public if not any(within(m, row) for row in listed)]
    assert sorted(uncovered) == []
