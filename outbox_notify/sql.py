"""Loads the SQL files shipped with the package: the DDL and the relay's named queries.

`python -m outbox_notify.sql NAME` prints one of them (`install.sql`, `relay_role.sql`,
`migrations/0001_initial.sql`, ...) for `psql`, from wherever the package is installed;
without NAME it lists them.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Sequence
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


def names() -> list[str]:
    """Every packaged SQL file, as its path in the `sql/` folder (`migrations/0001_initial.sql`)."""
    root = _sql_dir()
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*.sql"))


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
    sys.stdout.buffer.write((_sql_dir() / name).read_bytes())


if __name__ == "__main__":
    main()
