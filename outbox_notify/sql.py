"""Loads the SQL files shipped with the package: the DDL and the relay's named queries."""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

_NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_INCLUDE_LINE = re.compile(r"^[ \t]*--\s*include:\s*(\w+)\s*$", re.MULTILINE)


def _sql_dir() -> Path:
    """Where the .sql files are: inside the installed wheel, else the source checkout."""
    packaged = Path(str(resources.files("outbox_notify"))) / "sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "sql"


@functools.cache
def read(filename: str) -> str:
    """Return the text of one file of the `sql/` folder."""
    return (_sql_dir() / filename).read_text(encoding="utf-8")


def _sections(text: str) -> dict[str, str]:
    parts = _NAME_LINE.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@functools.cache
def fragments() -> dict[str, str]:
    """The shared fragments of `sql/fragments.sql` ({_NAME: text}), loaded once."""
    return _sections(read("fragments.sql"))


def parse_named_queries(text: str) -> dict[str, str]:
    """Split a file of `-- name: NAME` sections into {NAME: query}.

    A line `-- include: _NAME` in a query is replaced by the fragment _NAME of
    `sql/fragments.sql` (or of the file itself): SQL that several queries need is written once.
    A fragment is not a query of its own and is left out of the result.
    """
    sections = _sections(text)
    known = {**fragments(), **{n: b for n, b in sections.items() if n.startswith("_")}}

    def include(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in known:
            raise KeyError(f"`-- include: {name}` names no fragment (a `-- name: _...` section)")
        return known[name]

    return {
        name: _INCLUDE_LINE.sub(include, body)
        for name, body in sections.items()
        if not name.startswith("_")
    }


@functools.cache
def queries() -> dict[str, str]:
    """The relay's named queries from `sql/queries.sql`, loaded once."""
    return parse_named_queries(read("queries.sql"))
