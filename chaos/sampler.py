"""Samples the outbox while a scenario runs: how many rows wait, how old the oldest is, and
how many messages wait in the broker for the worker.

The relay's own lag, apart from the worker's: commit -> execution includes the worker's
queue, the oldest row's age does not.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox_notify.serialization import SCHEMA_VERSION

INTERVAL = 0.5  # seconds between samples
# The session holding the wake lock in exclusive mode (a relay asleep), and for how long it
# has been idle: a healthy sleeper runs a query at least every --sweep-interval.
WAKE_LOCK_SQL = """
SELECT coalesce(max(extract(epoch FROM now() - a.state_change)), 0)::float8
FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
WHERE l.locktype = 'advisory' AND l.classid = 1869968482 AND l.objid = 1
  AND l.mode = 'ExclusiveLock' AND l.granted AND a.state = 'idle'
"""
SAMPLE_SQL = """
SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
FROM outbox_notify_message_v1
WHERE schema_version <= %(max_version)s AND task_id NOT LIKE 'poison-%%'
"""


class OutboxSampler(threading.Thread):
    """Background sampling of (wall time, rows waiting, oldest row's age in seconds)."""

    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], queue_depth: Callable[[], int]
    ) -> None:
        super().__init__(name="outbox-sampler", daemon=True)
        self.connect = connect
        self.queue_depth = queue_depth
        self.samples: list[tuple[float, int, float]] = []
        self.broker_depths: list[int] = []
        self.wake_lock_idle: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        # The broker is sampled on a thread of its own: a frozen broker must not stall the
        # outbox samples (a command to it blocks until its timeout).
        broker = threading.Thread(target=self._sample_broker, name="broker-sampler", daemon=True)
        broker.start()
        while not self.done.is_set():
            with contextlib.suppress(psycopg.Error), self.connect() as conn:
                self._sample_until_error(conn)
            self.done.wait(INTERVAL)

    def _sample_until_error(self, conn: psycopg.Connection[Any]) -> None:
        while not self.done.wait(INTERVAL):
            row = conn.execute(SAMPLE_SQL, {"max_version": SCHEMA_VERSION}).fetchone()
            if row is not None:
                self.samples.append((time.time(), int(row[0]), float(row[1])))
            held = conn.execute(WAKE_LOCK_SQL).fetchone()
            if held is not None:
                self.wake_lock_idle.append((time.time(), float(held[0])))

    def _sample_broker(self) -> None:
        while not self.done.wait(INTERVAL):
            with contextlib.suppress(Exception):  # the broker may be the thing stopped
                self.broker_depths.append(self.queue_depth())

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)

    def figures(self, window: tuple[float, float]) -> dict[str, float | int]:
        """Largest backlog and oldest row overall, and the oldest row during the fault."""
        during = [age for at, _, age in self.samples if window[0] <= at <= window[1]]
        return {
            "outbox_max_rows": max((rows for _, rows, _ in self.samples), default=0),
            "outbox_max_age_s": round(max((age for _, _, age in self.samples), default=0.0), 3),
            "outbox_max_age_during_fault_s": round(max(during, default=0.0), 3),
            "broker_queue_max": max(self.broker_depths, default=0),
            "wake_lock_holder_max_idle_s": round(
                max((idle for _, idle in self.wake_lock_idle), default=0.0), 2
            ),
        }

    def age_timeline(self, origin: float) -> list[tuple[float, int, float]]:
        """(seconds since `origin`, rows waiting, oldest row's age), one per sample."""
        return [(round(at - origin, 1), rows, round(age, 2)) for at, rows, age in self.samples]
