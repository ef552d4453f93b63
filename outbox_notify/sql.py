"""Loads the SQL files shipped with the package: the DDL and the named queries.

`python -m outbox_notify.sql NAME` prints one of them (`install.sql`, `relay_role.sql`,
`migrations/0001_initial.sql`, ...) for `psql`, from wherever the package is installed;
without NAME it lists them.

Every query the package runs comes from here, typed `LiteralString` (as psycopg's
`execute()` asks): text read from the package's own files, never built from values. Type
checkers that enforce PEP 675 (pyright) then reject SQL formatted at run time; mypy reads
`LiteralString` as `str`, so tests/unit/test_sql_names.py also looks for formatted SQL
handed to `execute()`.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import LiteralString, TypeAlias

_NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_INCLUDE_LINE = re.compile(r"^([ \t]*)--\s*include:\s*(\w+)\s*$", re.MULTILINE)
_OPTIONAL_BLOCK = re.compile(
    r"^[ \t]*--\s*optional:\s*(\w+)[ \t]*\n.*?^[ \t]*--\s*end optional:\s*\1[ \t]*\n",
    re.MULTILINE | re.DOTALL,
)

# The files of named queries (`-- name: NAME` sections); fragments.sql holds the `_NAME`
# sections any of them may include.
QUERY_FILES = ("queries.sql", "ops.sql", "held.sql", "inbox.sql", "checks.sql")

Queries: TypeAlias = Mapping[str, LiteralString]


@functools.cache
def _sql_dir() -> Traversable:
    """The `sql/` folder, as a package resource.

    A wheel carries it inside the package (pyproject.toml maps the top-level `sql/` to
    `outbox_notify/sql`). A checkout, an editable install and an unpacked sdist import the
    package from the source tree, where `sql/` sits beside it: the same folder, read through
    the same Traversable calls.
    """
    packaged = resources.files("outbox_notify") / "sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "sql"


def _file(filename: str) -> Traversable:
    return _sql_dir().joinpath(*filename.split("/"))


def _trusted(text: str) -> LiteralString:
    """The one place text becomes LiteralString: text of the package's own files, not input."""
    # mypy reads LiteralString as str; a PEP 675 checker needs the exception said here.
    return text  # pyright: ignore[reportReturnType]


@functools.cache
def read(filename: str) -> LiteralString:
    """Return the text of one file of the `sql/` folder (`install.sql`, `migrations/...`)."""
    return _trusted(_file(filename).read_text(encoding="utf-8"))


def _sections(text: LiteralString) -> dict[str, LiteralString]:
    parts = _NAME_LINE.split(text)
    return {
        name: _trusted(body.strip()) for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


@functools.cache
def fragments() -> dict[str, LiteralString]:
    """The shared fragments of `sql/fragments.sql` ({_NAME: text}), unexpanded, loaded once."""
    return _sections(read("fragments.sql"))


def _without_doc(fragment: LiteralString) -> LiteralString:
    """A fragment without its leading comment lines: they explain it in fragments.sql, and
    would travel with every execution of every query that includes it."""
    lines = fragment.splitlines()
    while lines and lines[0].lstrip().startswith("--") and not _INCLUDE_LINE.match(lines[0]):
        del lines[0]
    return "\n".join(lines)


def _expand(body: LiteralString, known: Mapping[str, LiteralString], chain: tuple[str, ...]) -> str:
    """`body` with each `-- include: _NAME` line replaced by that fragment, expanded too."""

    def include(match: re.Match[str]) -> str:
        indent, name = match.group(1, 2)
        if name not in known:
            raise KeyError(f"`-- include: {name}` names no fragment (a `-- name: _...` section)")
        if name in chain:
            raise ValueError(f"fragments include each other: {' -> '.join((*chain, name))}")
        # The include line's indentation starts the fragment, for whoever reads the query
        # in pg_stat_activity or a log.
        return indent + _expand(_without_doc(known[name]), known, (*chain, name))

    return _INCLUDE_LINE.sub(include, body)


def without(query: LiteralString, *parts: str) -> LiteralString:
    """`query` without its `-- optional: PART` ... `-- end optional: PART` blocks for `parts`.

    The markers are comments: the query with every block in is the query as written. Raises
    ValueError for a part the query marks nowhere (a renamed marker must not go unnoticed).
    """
    found = {match.group(1) for match in _OPTIONAL_BLOCK.finditer(query)}
    unknown = set(parts) - found
    if unknown:
        raise ValueError(f"the query marks no optional part {sorted(unknown)}")
    dropped = _OPTIONAL_BLOCK.sub(lambda m: "" if m.group(1) in parts else m.group(0), query)
    return _trusted(dropped)


def parse_named_queries(text: LiteralString) -> dict[str, LiteralString]:
    """Split a file of `-- name: NAME` sections into {NAME: query}.

    A line `-- include: _NAME` in a query is replaced by the fragment _NAME of
    `sql/fragments.sql` (or of the file itself), whose own include lines are replaced in turn:
    SQL that several queries need is written once. A fragment is not a query of its own and
    is left out of the result.
    """
    sections = _sections(text)
    known = {**fragments(), **{n: b for n, b in sections.items() if n.startswith("_")}}
    return {
        name: _trusted(_expand(body, known, (name,)))
        for name, body in sections.items()
        if not name.startswith("_")
    }


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


@functools.cache
def positional(query: LiteralString) -> tuple[LiteralString, tuple[str, ...]]:
    """A named query in PostgreSQL's own `$1` style, for psycopg.RawCursor, and the names of
    its parameters in order (a name used twice is one parameter).

    psycopg turns `%(name)s` into `$1` at every execution, with regular expressions, and keeps
    the result only for queries under 4 KB; the claim is longer. Done once here, a claim's
    execution skips it.
    """
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"  # `%%`: a literal percent sign
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    if "%" in _PLACEHOLDER.sub("", query):
        raise ValueError("a placeholder other than %(name)s (or a lone %): keep to %(name)s")
    return _trusted(_PLACEHOLDER.sub(number, query)), tuple(names)


@functools.cache
def load(filename: str) -> Queries:
    """The named queries of one file of `sql/` (one of QUERY_FILES), loaded once."""
    return parse_named_queries(read(filename))


def queries() -> Queries:
    """The relay's named queries from `sql/queries.sql`, loaded once."""
    return load("queries.sql")


def _walk(folder: Traversable, prefix: str) -> Iterator[str]:
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _walk(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".sql"):
            yield f"{prefix}{entry.name}"


def names() -> list[str]:
    """Every packaged SQL file, as its path in the `sql/` folder (`migrations/0001_initial.sql`)."""
    return sorted(_walk(_sql_dir(), ""))


def _known_name(text: str) -> str:
    """An argparse type: the name of a packaged SQL file (`.sql` may be left out)."""
    known = names()
    for candidate in (text, f"{text}.sql"):
        if candidate in known:
            return candidate
    raise argparse.ArgumentTypeError(
        f"no SQL file named {text!r}; the files are: {', '.join(known)}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print one packaged SQL file byte for byte, or list them all without a NAME."""
    parser = argparse.ArgumentParser(
        prog="python -m outbox_notify.sql",
        description="Print an SQL file of the installed outbox-notify (for psql), or list them.",
    )
    parser.add_argument(
        "name", nargs="?", type=_known_name, metavar="NAME", help="e.g. install.sql"
    )
    name = parser.parse_args(argv).name
    if name is None:
        sys.stdout.write("".join(f"{known}\n" for known in names()))
        return
    sys.stdout.flush()
    sys.stdout.buffer.write(_file(name).read_bytes())


if __name__ == "__main__":
    main()
