"""What `manage.py outbox_list` shows: outbox rows (pending or held) and dead letters.

Rows are read page by page (keyset pagination through an index, the queries `list_*_page`
of sql/ops.sql), so a listing never holds a long transaction nor sorts a large table, and a
caller can show progress between pages. Arguments are shown through the redaction the admin
uses (`outbox_notify.redaction`), never raw.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections

from outbox_notify import conf, redaction
from outbox_notify.serialization import EVENT_VERSION
from outbox_notify.stats import queries

PAGE_SIZE = 1_000  # rows per query
ARGS_LIMIT = 120  # characters of the args and of the kwargs shown per row
_EPOCH = datetime(1, 1, 1, tzinfo=UTC)  # before any retry_after: the first held page


class State(enum.Enum):
    """Which rows to list."""

    PENDING = "pending"  # in the outbox, ready now or waiting for a retry
    HELD = "held"  # in the outbox, held until their ETA (never tried)
    DEAD = "dead"  # dead letters


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Filters:
    """What to list: a state, then optional filters; None turns a filter off."""

    state: State
    task_name: str | None = None
    older_than: float | None = None  # seconds: created_at (pending, held) or dead_at (dead)
    error_contains: str | None = None  # case-insensitive, in last_error / failure_reason
    limit: int = 100


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Listed:
    """One row as listed: times in ISO 8601, arguments redacted."""

    id: int
    task_id: str
    task_name: str
    kind: str  # "task" or "event"
    retries: int
    created_at: str
    due_at: str | None  # pending and held: retry_after (None: ready now); dead: None
    dead_at: str | None
    error: str | None  # last_error, or the dead letter's failure_reason
    arguments: str  # redacted, each part cut to ARGS_LIMIT characters

    def as_dict(self) -> dict[str, Any]:
        """The row as `--format json` prints it."""
        return dataclasses.asdict(self)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _arguments(task_name: str, version: int, args: str, kwargs: str) -> str:
    try:
        decoded_args, decoded_kwargs = json.loads(args), json.loads(kwargs)
    except ValueError:
        return redaction.FAILED
    if version == EVENT_VERSION:
        data = decoded_args[0] if isinstance(decoded_args, list) and decoded_args else None
        return redaction.display_event(task_name, data, ARGS_LIMIT)
    if not isinstance(decoded_args, list) or not isinstance(decoded_kwargs, dict):
        return redaction.FAILED
    return redaction.display(task_name, decoded_args, decoded_kwargs, ARGS_LIMIT)


def _listed(state: State, row: tuple[Any, ...]) -> Listed:
    id_, task_id, task_name, version, args, kwargs, retries, when, error, created = row
    dead = state is State.DEAD
    return Listed(
        id=int(id_),
        task_id=task_id,
        task_name=task_name,
        kind="event" if version == EVENT_VERSION else "task",
        retries=int(retries),
        created_at=created.isoformat(),
        due_at=None if dead else _iso(when),
        dead_at=_iso(when) if dead else None,
        error=error,
        arguments=_arguments(task_name, version, args, kwargs),
    )


def _cutoff(cur: Any, older_than: float | None) -> datetime | None:
    """now() on the database's clock minus `older_than` seconds (the clock the rows use)."""
    if older_than is None:
        return None
    cur.execute(queries()["database_now"])
    now: datetime = cur.fetchone()[0]
    return now - timedelta(seconds=older_than)


def rows(
    filters: Filters, *, using: str | None = None, page_size: int = PAGE_SIZE
) -> Iterator[Listed]:
    """The matching rows, in the state's order, at most `filters.limit`, read page by page."""
    query = queries()[f"list_{filters.state.value}_page"]
    left = filters.limit
    with connections[using or conf.database_alias()].cursor() as cur:
        params: dict[str, Any] = {
            "task_name": filters.task_name,
            "cutoff": _cutoff(cur, filters.older_than),
            "error": filters.error_contains,
            "after": 0,
            "after_at": _EPOCH,
        }
        while left > 0:
            wanted = min(page_size, left)
            cur.execute(query, {**params, "page": wanted})
            page = cur.fetchall()
            for row in page:
                yield _listed(filters.state, row)
            if len(page) < wanted:
                return
            left -= wanted
            params["after"], params["after_at"] = page[-1][0], page[-1][7]


Columns = list[tuple[str, Callable[[Listed], str]]]


def _age_column(state: State) -> Columns:
    if state is State.DEAD:
        return [("dead_at", lambda r: (r.dead_at or "")[:19])]
    return [("due_at", lambda r: (r.due_at or "now")[:19])]


def columns(state: State) -> Columns:
    """The table's columns for a state: header and how to show a row."""
    return [
        ("id", lambda r: str(r.id)),
        ("task_name", lambda r: r.task_name),
        ("task_id", lambda r: r.task_id),
        ("retries", lambda r: str(r.retries)),
        ("created_at", lambda r: r.created_at[:19]),
        *_age_column(state),
        ("error", lambda r: redaction.truncate(" ".join((r.error or "").split()), 60)),
        ("arguments", lambda r: r.arguments),
    ]


def table(state: State, listed: list[Listed]) -> list[str]:
    """The rows as aligned text lines, a header first (the last column is not padded)."""
    cols = columns(state)
    cells = [[header for header, _ in cols]] + [[show(r) for _, show in cols] for r in listed]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols) - 1)]
    return [
        "  ".join([*(cell.ljust(w) for cell, w in zip(line, widths, strict=False)), line[-1]])
        for line in cells
    ]
