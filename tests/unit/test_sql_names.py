"""The named queries and the code agree: every name the package asks for is a query of the
`sql/` files, every query is asked for, every `-- include:` resolves without a cycle, and no
SQL formatted at run time reaches a cursor.

The package's source is read as Python syntax (ast), so these hold for code paths no other
test runs.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from outbox_notify import deadletter, inbox, sql
from outbox_notify.deadletter import Selector
from outbox_notify.listing import State

PACKAGE = Path(sql.__file__).resolve().parent
INCLUDE = re.compile(r"^[ \t]*--\s*include:\s*(\w+)\s*$", re.MULTILINE)

# Lookups whose name is computed, each with the names it can compute (from the code itself).
DYNAMIC: dict[tuple[str, str], frozenset[str]] = {
    ("listing.py", "rows"): frozenset(f"list_{state.value}_page" for state in State),
    ("_purging.py", "plan"): frozenset(t.plan for t in (inbox.KEYS, deadletter.DEAD_LETTERS)),
    ("_purging.py", "delete_chunk"): frozenset(
        t.chunk for t in (inbox.KEYS, deadletter.DEAD_LETTERS)
    ),
    ("deadletter.py", "_requeue_chunk"): frozenset(
        selector.query()[0]
        for selector in (Selector(ids=(1,)), Selector(task_name="t"), Selector(everything=True))
    ),
}
# Queries the package does not run: kept for the operators and tools that read them by name.
UNUSED: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Lookup:
    """One `queries()[...]` of the package: where, and the names it may ask for (None: computed)."""

    module: str
    function: str
    names: frozenset[str] | None


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _is_query_map(node: ast.expr) -> bool:
    """`queries()`, `sql.queries()`, `sql.load(...)`, `self.queries`: a mapping of named queries."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        return name in {"queries", "load"}
    return isinstance(node, ast.Attribute) and node.attr == "queries"


def _constants(node: ast.expr) -> frozenset[str] | None:
    """The names a key can be: a string, or either string of a conditional; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return frozenset({node.value})
    if isinstance(node, ast.IfExp):
        body, orelse = _constants(node.body), _constants(node.orelse)
        if body is not None and orelse is not None:
            return body | orelse
    return None


def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            yield node


def _parameters(function: ast.FunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


@dataclass(frozen=True)
class Passer:
    """A function that looks up a query named by one of its parameters."""

    position: int  # of that parameter among a caller's positional arguments
    keyword: str


def _passers(modules: list[tuple[str, ast.Module]]) -> dict[str, set[Passer]]:
    """Functions that look up a query named by one of their parameters, by function name.

    `scalar(cur, name)` runs `queries()[name]`; so does `bounded_count(cur, count_name, ...)`
    through scalar: found until nothing new turns up.
    """
    found: dict[str, set[Passer]] = {}
    changed = True
    while changed:
        changed = False
        for _, tree in modules:
            for function in _functions(tree):
                params = _parameters(function)
                bound = 1 if params and params[0] in {"self", "cls"} else 0
                for key in _keys(function, found):
                    if not (isinstance(key, ast.Name) and key.id in params):
                        continue
                    passer = Passer(params.index(key.id) - bound, key.id)
                    if passer not in found.setdefault(function.name, set()):
                        found[function.name].add(passer)
                        changed = True
    return found


def _keys(function: ast.FunctionDef, passers: dict[str, set[Passer]]) -> Iterator[ast.expr]:
    """What `function` names a query with: subscripts of query maps and passers' arguments."""
    for node in ast.walk(function):
        if isinstance(node, ast.Subscript) and _is_query_map(node.value):
            yield node.slice
        elif isinstance(node, ast.Call):
            func = node.func
            called = passers.get(
                func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            )
            for passer in called or ():
                yield from _argument(node, passer)


def _argument(call: ast.Call, passer: Passer) -> Iterator[ast.expr]:
    if passer.position < len(call.args):
        yield call.args[passer.position]
    yield from (k.value for k in call.keywords if k.arg == passer.keyword)


def _lookups() -> list[Lookup]:
    modules = list(_modules())
    passers = _passers(modules)
    found = []
    for module, tree in modules:
        for function in _functions(tree):
            params = _parameters(function)
            for key in _keys(function, passers):
                if isinstance(key, ast.Name) and key.id in params:
                    continue  # a passer's own lookup: its callers' arguments are the names
                found.append(Lookup(module, function.name, _constants(key)))
    return found


def _loaded() -> set[str]:
    return {name for filename in sql.QUERY_FILES for name in sql.load(filename)}


def _asked() -> set[str]:
    asked: set[str] = set()
    for lookup in _lookups():
        names = lookup.names
        if names is None:
            names = DYNAMIC.get((lookup.module, lookup.function))
        assert names is not None, (
            f"{lookup}: a computed query name; list what it computes in DYNAMIC"
        )
        asked |= names
    return asked


def test_the_scan_finds_the_lookups_it_must() -> None:
    """The scan sees direct lookups, conditional ones, passers' callers and computed names."""
    asked = _asked()
    assert {"claim_batch", "await_wake_lock", "await_wake_lock_bounded"} <= asked
    assert {"count_messages_upto", "estimate_messages", "oldest_pending"} <= asked  # via scalar
    assert {"list_pending_page", "list_held_page", "list_dead_page"} <= asked


def test_every_query_name_asked_for_exists() -> None:
    """No lookup of the package names a query missing from the `sql/` files."""
    assert _asked() - _loaded() == set()


def test_every_query_is_used() -> None:
    """Every named query is asked for by name somewhere in the package, or listed in UNUSED."""
    strings = {
        node.value
        for _, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    used = strings | _asked()
    assert _loaded() - used - UNUSED == set()
    assert _loaded() >= UNUSED


def test_every_include_resolves_and_no_fragment_is_dead() -> None:
    """Each loaded query is free of include lines, and each fragment is included somewhere."""
    included: set[str] = set()
    for filename in ("fragments.sql", *sql.QUERY_FILES):
        included |= set(INCLUDE.findall(sql.read(filename)))
        for name, query in sql.load(filename).items():
            assert not INCLUDE.search(query), (filename, name)
    fragments = set(
        re.findall(
            r"^--\s*name:\s*(_\w+)",
            "\n".join(sql.read(f) for f in ("fragments.sql", *sql.QUERY_FILES)),
            re.MULTILINE,
        )
    )
    assert fragments - included == set()


def test_an_include_of_a_missing_fragment_is_an_error() -> None:
    """A typo in an include line fails at load, naming the fragment."""
    with pytest.raises(KeyError, match="_nowhere"):
        sql.parse_named_queries("-- name: q\nSELECT\n-- include: _nowhere\n;")


def test_fragments_that_include_each_other_are_an_error() -> None:
    """An include cycle fails at load with the chain, instead of recursing forever."""
    text = "-- name: _a\n-- include: _b\n-- name: _b\n-- include: _a\n-- name: q\n-- include: _a\n"
    with pytest.raises(ValueError, match="q -> _a -> _b -> _a"):
        sql.parse_named_queries(text)


def test_an_include_nests() -> None:
    """A fragment's own include lines expand, and its leading comment lines stay behind."""
    text = "-- name: _a\n-- about a\n1\n-- include: _b\n-- name: _b\n2\n-- name: q\nSELECT\n-- include: _a\n"
    assert sql.parse_named_queries(text) == {"q": "SELECT\n1\n2"}


FORMATTED = (ast.JoinedStr, ast.BinOp)


def _formats(node: ast.expr) -> bool:
    """An f-string, `+`/`%` composition or `.format()` call: SQL built at run time."""
    if isinstance(node, FORMATTED):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and not _psycopg_composed(node.func.value)
    )


def _psycopg_composed(node: ast.expr) -> bool:
    """`pgsql.SQL(query).format(...)`: psycopg quotes what it composes (identifiers)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "SQL"
    )


def test_no_formatted_sql_reaches_a_cursor() -> None:
    """execute()/copy() calls of the package take named queries, not SQL formatted in Python.

    mypy reads LiteralString as str, so this is the check mypy --strict does not make.
    """
    offenders = [
        f"{module}:{node.lineno}"
        for module, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"execute", "executemany", "copy"}
        and node.args
        and _formats(node.args[0])
    ]
    assert offenders == []


def test_positional_numbers_each_name_once_in_order_of_first_use() -> None:
    text, names = sql.positional("SELECT %(b)s, %(a)s, %(b)s::int, '100%%' -- %(c)s\n")
    assert text == "SELECT $1, $2, $1::int, '100%' -- $3\n"
    assert names == ("b", "a", "c")


def test_the_claim_in_positional_form_takes_every_parameter_the_relay_gives() -> None:
    """The relay fills the claim's `$n` from the frontier's parameters and the claim's own."""
    from outbox_notify.relay.frontier import Frontier

    text, names = sql.positional(sql.queries()["claim_batch"])
    given = {**Frontier().params(), "limit": 1, "max_version": 1}
    assert set(names) == set(given)
    assert "%(" not in text
    assert f"${len(names)}" in text


def test_without_leaves_out_the_marked_parts_and_nothing_else() -> None:
    """The claim's recheck and late parts come out whole, with their lists and parameters."""
    claim = sql.queries()["claim_batch"]
    assert sql.without(claim) == claim
    lean = sql.without(claim, "recheck", "late")
    for gone in ("AS rechecked", "AS late_ready", "AS late_due", "'recheck_left'", "'late_left'"):
        assert gone in claim
        assert gone not in lean
    for kept in ("AS ready", "AS fresh", "FROM due", "'due_left'", "'ready_left'"):
        assert kept in lean
    _, names = sql.positional(lean)
    assert "recheck" not in names
    assert "late" not in names
    _, names = sql.positional(sql.without(claim, "late"))
    assert "recheck" in names
    assert "late" not in names


def test_without_refuses_a_part_the_query_does_not_mark() -> None:
    with pytest.raises(ValueError, match="no optional part"):
        sql.without(sql.queries()["claim_batch"], "recheck", "held")
