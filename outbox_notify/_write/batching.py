"""Bulk enqueue: many tasks in one transaction, written with one COPY per batch.

    from outbox_notify import bulk

    with bulk():                      # a transaction (or a savepoint inside one)
        for user in users:
            send_digest.delay(user.pk)   # collected, not written yet
    # written when the block ends, in batches of `batch_size` rows, one round trip each

Inside the block every `delay()`/`apply_async()`/`send_task()` of an `OutboxCelery` app
returns its `AsyncResult` at once and its row is kept in memory; Celery's `group()` (and
`chunks`, and a chord's header) does the same by itself, so a group of N tasks is one COPY.
The messages are the ones single calls store, and bad arguments raise the same
`SerializationError` at the call. When the block raises, nothing of it is written.

Messages are built as for single calls (repeated shapes from their template, see
`message_templates.py`); only the writing is batched. A full batch's COPY runs on a writer thread
while the block builds the next one (PostgreSQL stores one batch while Python makes the
next); the block's next query, its savepoints, its end and the COMMIT wait for it first, and
an error of that COPY is raised there (deferred.py). The last batch is written when the
block ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from django.db import transaction

from outbox_notify import _chord_calls as chord_calls
from outbox_notify import serialization
from outbox_notify._write import settings as write_settings
from outbox_notify._write.rows import insert_rows
from outbox_notify.serialization import OutboxRow

DEFAULT_BATCH_SIZE = 5_000  # rows per COPY: one round trip each, bounded memory

_active: contextvars.ContextVar[Collector | None] = contextvars.ContextVar(
    "outbox_notify_bulk", default=None
)


class GroupProducer:
    """What Celery's group hands its members as `producer=` while they are collected."""

    serializer = None  # Celery's eager path reads it; the outbox never publishes with it


@dataclasses.dataclass(kw_only=True)
class Collector:
    """The rows of one bulk block, written in batches to the outbox alias."""

    alias: str
    app: Any
    batch_size: int = DEFAULT_BATCH_SIZE
    # Full batches are written by a COPY on a writer thread while the block goes on.
    background: bool = False
    rows: list[OutboxRow] = dataclasses.field(default_factory=list)
    written: int = 0
    # A group's fan-out (for_group): rows of nested fan-outs join it; these are the spans of
    # its rows (start, end) that carry a chord's result-backend calls (_chord_calls.py).
    fan_out: bool = False
    spans: list[tuple[int, int, list[dict[str, Any]]]] = dataclasses.field(default_factory=list)

    def add(self, row: OutboxRow) -> None:
        """Keep a validated row; write a batch once `batch_size` rows wait."""
        self.rows.append(row)
        if len(self.rows) >= self.batch_size:
            self.flush(background=self.background)

    def flush(self, *, background: bool = False) -> None:
        """Write what is waiting, in one COPY (run on a writer thread with `background`)."""
        rows, self.rows = self.rows, []
        insert_rows(rows, self.alias, self.app, background=background)
        self.written += len(rows)


def active() -> Collector | None:
    """The collector of the innermost bulk block (or group) running here, if any."""
    return _active.get()


@contextlib.contextmanager
def bulk(
    *, using: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE, app: Any = None
) -> Iterator[Collector]:
    """Collect the tasks enqueued in the block; write them in batches when it ends.

    The block runs in `transaction.atomic(using=...)` (a savepoint inside an existing
    transaction), so the batches written before the end are undone if the block raises.
    `using` defaults to OUTBOX_NOTIFY_DATABASE; rows for another alias are written one by one.

    .. versionadded:: 0.1.0
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    alias = using or write_settings.current().alias
    collector = Collector(alias=alias, app=app, batch_size=batch_size, background=True)
    with transaction.atomic(using=alias):
        token = _active.set(collector)
        try:
            yield collector
        finally:
            _active.reset(token)
        collector.flush()


@contextlib.contextmanager
def for_group(app: Any) -> Iterator[GroupProducer]:
    """Celery's group fan-out: collect its rows, then join the running bulk block or write them.

    A group sent inside another group's fan-out (a chord in a group, a chord's header holding
    a chord) adds its rows to that fan-out. The rows are kept together until the outermost
    fan-out ends, so each chord's header rows all carry its result-backend calls (_chord_calls.py).
    """
    outer = _active.get()
    if outer is not None and outer.fan_out:
        start = len(outer.rows)
        with chord_calls.fan_out() as current:
            yield GroupProducer()
        calls = chord_calls.calls_of(current)
        if calls:
            outer.spans.append((start, len(outer.rows), calls))
        return
    alias = outer.alias if outer is not None else write_settings.current().alias
    collector = Collector(alias=alias, app=app, batch_size=2**62, fan_out=True)
    token = _active.set(collector)
    try:
        with chord_calls.fan_out() as current:
            yield GroupProducer()
        calls = chord_calls.calls_of(current)
        if calls:
            collector.spans.append((0, len(collector.rows), calls))
    finally:
        _active.reset(token)
        chord_calls.discard()
    rows = _with_calls(collector)
    if outer is None:
        collector.rows = rows
        collector.flush()
        return
    for row in rows:
        outer.add(row)


def _with_calls(collector: Collector) -> list[OutboxRow]:
    """The fan-out's rows, each carrying the calls of every span it is in (once per row)."""
    if not collector.spans:
        return collector.rows
    calls: dict[int, list[dict[str, Any]]] = {}
    for start, end, span_calls in collector.spans:
        for index in range(start, end):
            calls.setdefault(index, []).extend(span_calls)
    return [
        serialization.with_backend_calls(row, calls[index]) if index in calls else row
        for index, row in enumerate(collector.rows)
    ]
