"""OnceTask tasks for the tests, run eagerly in the test process and by real workers.

Each body writes an `Effect` row, so counting rows counts the effects that committed. In a
worker (OUTBOX_TEST_RECORD_FILE set) every delivery of these tasks is also recorded, skipped
ones included, from Celery's task_prerun/task_postrun signals: outside the body's transaction.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery import signals
from django.db import IntegrityError

from outbox_notify import OnceTask
from outbox_notify.exceptions import MarkedForRollback
from tests.celery_app import app, record

PREFIX = "tests.once."
RETRY_COUNTDOWN = 0.2  # seconds
MAX_RETRIES = 3
GATE_TIMEOUT = 60.0  # seconds a gated body waits to be released before failing


class Gate:
    """Holds a body inside its transaction until the test releases it (in-process tests)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = False


GATES: dict[str, Gate] = {}


def write_effect(task: Any, marker: str) -> None:
    """Insert one Effect row on the outbox database, in the body's transaction."""
    from tests.testapp.models import Effect

    request = task.request
    Effect.objects.create(marker=marker, task_id=request.id or "", attempt=request.retries or 0)


def _pass_gate(name: str) -> None:
    gate = GATES[name]
    gate.entered.set()
    if not gate.release.wait(GATE_TIMEOUT):
        raise TimeoutError(f"gate {name!r} was never released")
    if gate.fail:
        raise RuntimeError(f"gate {name!r} fails the body")


@app.task(name=PREFIX + "effect", base=OnceTask, bind=True)
def effect(
    self: Any,
    marker: str,
    *,
    fail: bool = False,
    sleep: float = 0.0,
    enqueue: bool = False,
    gate: str | None = None,
) -> str:
    """Write an effect; optionally enqueue a task, hold at a gate, sleep, then fail."""
    write_effect(self, marker)
    if enqueue:
        record.delay(marker)
    if gate is not None:
        _pass_gate(gate)
    time.sleep(sleep)
    if fail:
        raise RuntimeError(f"{marker} fails on purpose")
    return marker


@app.task(name=PREFIX + "late", base=OnceTask, bind=True, acks_late=True)
def late(self: Any, marker: str) -> str:
    """acks_late: write an effect, then sleep OUTBOX_TEST_BODY_SLEEP seconds (a worker to kill)."""
    write_effect(self, marker)
    time.sleep(float(os.environ.get("OUTBOX_TEST_BODY_SLEEP", "0")))
    return marker


@app.task(name=PREFIX + "retry", base=OnceTask, bind=True, max_retries=MAX_RETRIES)
def retrying(self: Any, marker: str, failures: int) -> int:
    """Write an effect, then self.retry() until `failures` attempts have failed."""
    write_effect(self, marker)
    if self.request.retries < failures:
        raise self.retry(countdown=RETRY_COUNTDOWN)
    return int(self.request.retries)


@app.task(
    name=PREFIX + "autoretry",
    base=OnceTask,
    bind=True,
    autoretry_for=(RuntimeError,),
    retry_kwargs={"countdown": RETRY_COUNTDOWN, "max_retries": MAX_RETRIES},
)
def autoretrying(self: Any, marker: str, failures: int) -> int:
    """Write an effect, then raise RuntimeError (autoretry_for) until `failures` attempts failed."""
    write_effect(self, marker)
    if self.request.retries < failures:
        raise RuntimeError(f"{marker} attempt {self.request.retries} fails")
    return int(self.request.retries)


def _collide_at_commit() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO testapp_deferred_unique (value) VALUES (1), (1)")


@app.task(
    name=PREFIX + "commit_fails",
    base=OnceTask,
    bind=True,
    autoretry_for=(IntegrityError,),
    retry_kwargs={"countdown": RETRY_COUNTDOWN, "max_retries": MAX_RETRIES},
)
def commit_fails(self: Any, marker: str, failures: int) -> int:
    """Write an effect; until `failures` attempts failed, also a conflict PostgreSQL finds at COMMIT."""
    write_effect(self, marker)
    if self.request.retries < failures:
        _collide_at_commit()
    return int(self.request.retries)


def _carry_on_after_rollback(how: str) -> None:
    """Leave the body's transaction unable to commit and carry on, as careless bodies do.

    `orm`: a unique violation through the ORM, caught (Django marks the block for rollback);
    `raw`: an error of a raw cursor, caught (the transaction is aborted, nothing marked);
    `set_rollback`: `transaction.set_rollback(True)`.
    """
    from django.db import DatabaseError, connection, transaction

    from tests.testapp.models import Effect

    if how == "set_rollback":
        transaction.set_rollback(True)
        return
    try:
        if how == "orm":
            first = Effect.objects.order_by("id").first()
            assert first is not None
            Effect.objects.create(id=first.id, marker="clash", task_id="", attempt=0)
        else:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
    except DatabaseError:
        pass


@app.task(name=PREFIX + "swallow", base=OnceTask, bind=True)
def swallow(self: Any, marker: str, how: str | None) -> str:
    """Write an effect, then (unless `how` is None) leave the transaction unable to commit."""
    write_effect(self, marker)
    if how is not None:
        _carry_on_after_rollback(how)
    return marker


@app.task(
    name=PREFIX + "swallow_retried",
    base=OnceTask,
    bind=True,
    autoretry_for=(MarkedForRollback,),
    retry_kwargs={"countdown": RETRY_COUNTDOWN, "max_retries": MAX_RETRIES},
)
def swallow_retried(self: Any, marker: str, failures: int) -> int:
    """Write an effect; until `failures` attempts failed, swallow a unique violation."""
    write_effect(self, marker)
    if self.request.retries < failures:
        _carry_on_after_rollback("orm")
    return int(self.request.retries)


@app.task(
    name=PREFIX + "confirm",
    base=OnceTask,
    bind=True,
    once_key=lambda order_id, marker: f"order:{order_id}",
)
def confirm_order(self: Any, order_id: int, marker: str) -> None:
    """Confirm an order once, however many messages ask for it (business key)."""
    write_effect(self, marker)


@app.task(
    name=PREFIX + "ship",
    base=OnceTask,
    bind=True,
    once_key=lambda order_id, marker: f"order:{order_id}",
)
def ship_order(self: Any, order_id: int, marker: str) -> None:
    """Same key function as confirm_order, its own scope: the two never skip each other."""
    write_effect(self, marker)


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("OUTBOX_TEST_RECORD_FILE")
    if path and str(entry["name"]).startswith(PREFIX):
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


@signals.task_prerun.connect
def _delivered(sender: Any = None, task_id: str = "", args: Any = (), **_: Any) -> None:
    _record(
        {
            "event": "prerun",
            "name": sender.name,
            "id": task_id,
            "args": list(args),
            "at": time.time(),
            "pid": os.getpid(),
        }
    )


@signals.task_postrun.connect
def _finished(sender: Any = None, task_id: str = "", state: Any = None, **_: Any) -> None:
    _record(
        {"event": "postrun", "name": sender.name, "id": task_id, "state": state, "at": time.time()}
    )


@app.task(name=PREFIX + "isolation", base=OnceTask, bind=True)
def isolation(self: Any) -> str:
    """Write an effect whose marker is the isolation level the body's transaction runs at."""
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT current_setting('transaction_isolation')")
        level = str(cursor.fetchone()[0])
    write_effect(self, level)
    return level
