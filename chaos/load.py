"""The load generator: writer threads commit (or roll back on purpose) one message each time.

Every transaction inserts a business row (ledger Order) and enqueues `chaos.record` through
the outbox, both on the writer's Django connection. The generator remembers every task id:
committed (with the wall-clock time the commit returned), rolled back on purpose, aborted by a
database error before COMMIT was sent, or ambiguous (the COMMIT itself failed: the Order table
says afterwards whether it happened).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
import uuid

from django.db import Error, connection, transaction

WRITERS = 16
ROLLBACK_SHARE = 0.2
ERROR_PAUSE = 0.1  # seconds a writer waits after a database error (server restarting)


class RollBack(Exception):
    """Raised inside a writer's transaction to roll it back on purpose."""


@dataclasses.dataclass
class Tally:
    """What the writers did, keyed by task id. Guarded by `lock`."""

    committed: dict[str, float] = dataclasses.field(default_factory=dict)
    rolled_back: set[str] = dataclasses.field(default_factory=set)
    aborted: set[str] = dataclasses.field(default_factory=set)
    ambiguous: dict[str, float] = dataclasses.field(default_factory=dict)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        with self.lock:
            self.errors[name] = self.errors.get(name, 0) + 1

    def commit_times(self) -> list[float]:
        with self.lock:
            return sorted(self.committed.values())


class LoadGenerator:
    """WRITERS threads, each committing at most `rate` transactions a second."""

    def __init__(
        self, scenario: str, queue: str, *, rate: float, seed: int, writers: int = WRITERS
    ) -> None:
        self.scenario = scenario
        self.queue = queue
        self.interval = 1.0 / rate
        self.seed = seed
        self.writers = writers
        self.tally = Tally()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.seq = 0
        self.seq_lock = threading.Lock()

    def start(self) -> None:
        for index in range(self.writers):
            thread = threading.Thread(
                target=self._run, args=(index,), name=f"writer-{index}", daemon=True
            )
            self.threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the writers and wait for each one's transaction in hand."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _next_seq(self) -> int:
        with self.seq_lock:
            self.seq += 1
            return self.seq

    def _run(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        next_at = time.monotonic() + rng.random() * self.interval
        try:
            while not self.stop_event.is_set():
                delay = next_at - time.monotonic()
                if delay > 0 and self.stop_event.wait(delay):
                    break
                next_at = max(next_at + self.interval, time.monotonic())
                self.write_one(rollback=rng.random() < ROLLBACK_SHARE)
        finally:
            with contextlib.suppress(Error):
                connection.close()

    def write_one(self, *, rollback: bool) -> None:
        """One transaction: a business row and a message, committed or rolled back."""
        from chaos.celery_app import record
        from chaos.ledger.models import Order

        task_id = str(uuid.uuid4())
        committing = False
        try:
            with transaction.atomic():
                Order._default_manager.create(task_id=task_id, scenario=self.scenario)
                record.apply_async(
                    (self.scenario, self._next_seq()), task_id=task_id, queue=self.queue
                )
                if rollback:
                    raise RollBack
                committing = True
            with self.tally.lock:
                self.tally.committed[task_id] = time.time()
        except RollBack:
            with self.tally.lock:
                self.tally.rolled_back.add(task_id)
        except Error as exc:
            self._failed(task_id, exc, committing=committing)

    def _failed(self, task_id: str, exc: Error, *, committing: bool) -> None:
        self.tally.error(exc)
        with self.tally.lock:
            if committing:
                self.tally.ambiguous[task_id] = time.time()
            else:
                self.tally.aborted.add(task_id)
        with contextlib.suppress(Error):
            connection.close()
        time.sleep(ERROR_PAUSE)
