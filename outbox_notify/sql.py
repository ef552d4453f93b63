"""Loads the SQL files shipped with the package: the DDL and the relay's named queries."""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

_NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


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


def parse_named_queries(text: str) -> dict[str, str]:
    """Split a file of `-- name: NAME` sections into {NAME: query}."""
    parts = _NAME_LINE.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@functools.cache
def queries() -> dict[str, str]:
    """The relay's named queries from `sql/queries.sql`, loaded once."""
    return parse_named_queries(read("queries.sql"))
