"""The relay's index keeper: rebuilds the outbox's indexes once an old snapshot has let go.

After a snapshot held published rows back, autovacuum frees the table and truncates its empty
tail within a round or two, but the indexes keep the size they reached (a B-tree only reuses
its empty pages). Every CHECK_INTERVAL a thread of the relay looks, on a connection of its own:
when no snapshot holds many dead rows back and the indexes take far more than the table itself
(outbox_notify/reindex.py, `bloated`), it rebuilds them with REINDEX INDEX CONCURRENTLY, which
blocks neither writers nor claims. One relay at a time (a session advisory lock); at most once
per MIN_GAP per relay. A role that does not own the indexes cannot rebuild them: the keeper
then warns (outbox.reindex_needed) and `manage.py outbox_reindex`, run as the owner, does it.

The thread runs beside the relay loop and shares nothing with it but the process: a keeper that
fails logs and tries again at its next check, and the relay never waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
import structlog

from outbox_notify import reindex, stats

log = structlog.get_logger("outbox_notify")

CHECK_INTERVAL = 60.0  # seconds between two looks at the outbox's sizes
MIN_GAP = 600.0  # seconds after a rebuild (or an attempt) before this relay tries again
WARNING_INTERVAL = 1800.0  # seconds between two outbox.reindex_needed warnings
LOCK_WAIT = 60.0  # seconds a rebuild waits for the transactions running when it began
# Dead rows a snapshot may still hold back for a rebuild to go ahead (as outbox_reindex).
REFUSE_ABOVE = 100_000
STOP_WAIT = 5.0  # seconds stop() waits for a rebuild it cancelled


class IndexKeeper:
    """Looks at the outbox's index sizes now and then, and rebuilds them when bloated."""

    def __init__(
        self,
        params: dict[str, Any] | str,
        *,
        interval: float | None = None,
        min_bytes: int | None = None,
        refuse_above: int = REFUSE_ABOVE,
    ) -> None:
        """`interval` and `min_bytes` default to CHECK_INTERVAL and reindex.BLOAT_MIN_BYTES."""
        self.params = params
        self.interval = CHECK_INTERVAL if interval is None else interval
        self.min_bytes = reindex.BLOAT_MIN_BYTES if min_bytes is None else min_bytes
        self.refuse_above = refuse_above
        self.conn: psycopg.Connection[Any] | None = None
        self.next_try = 0.0
        self.next_warning = 0.0
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> IndexKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="outbox-index-keeper", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread; a rebuild in progress is cancelled (the next one cleans up)."""
        self.stopping.set()
        conn = self.conn
        if conn is not None and not conn.closed:
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=STOP_WAIT)
        if self.thread is not None:
            self.thread.join(STOP_WAIT)
        self._close()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.check()
            except Exception as exc:  # a keeper never takes the relay down
                if not self.stopping.is_set():
                    log.warning("outbox.reindex_failed", error=" ".join(str(exc).split()))
                self._close()

    # -- one look ---------------------------------------------------------------------------

    def check(self) -> str:
        """Look once and act; what it found: 'waiting', 'held', 'fine', 'not owned', 'busy'
        (another relay is rebuilding) or 'rebuilt'."""
        now = time.monotonic()
        if now < self.next_try:
            return "waiting"
        cur = self._connection().cursor()
        dead_rows, holder = stats.vacuum_horizon(cur)
        if holder is not None and dead_rows > self.refuse_above:
            return "held"  # a rebuilt index would keep them: the relay warns about the holder
        found = reindex.indexes(cur)
        heap = reindex.table_bytes(cur)
        if not reindex.bloated(heap, found, min_bytes=self.min_bytes):
            return "fine"
        size = sum(index.bytes for index in found)
        if not all(index.owned for index in found):
            if now >= self.next_warning:
                self.next_warning = now + WARNING_INTERVAL
                log.warning(
                    "outbox.reindex_needed",
                    index_bytes=size,
                    table_bytes=heap,
                    hint="run manage.py outbox_reindex as the tables' owner (docs/operations.md)",
                )
            return "not owned"
        cur.execute(stats.queries()["try_reindex_lock"])
        locked = cur.fetchone()
        if not (locked and locked[0]):
            return "busy"
        self.next_try = now + MIN_GAP
        try:
            log.info("outbox.reindex_started", index_bytes=size, table_bytes=heap)
            started = time.monotonic()
            done = reindex.rebuild(
                cur, found, min_size=0, lock_wait=LOCK_WAIT, say=lambda line: None
            )
        finally:
            cur.execute(stats.queries()["reindex_unlock"])
        log.info(
            "outbox.reindex_done",
            before_bytes=done.before,
            after_bytes=done.after,
            seconds=round(time.monotonic() - started, 1),
            gave_up=list(done.failed + done.undropped) or None,
        )
        return "rebuilt"

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed:
            if isinstance(self.params, str):
                self.conn = psycopg.connect(self.params, autocommit=True)
            else:
                self.conn = psycopg.connect(**self.params, autocommit=True)
        return self.conn

    def _close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
