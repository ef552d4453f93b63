"""What the chaos task runs inside the worker: the execution ledger and the effect.

Every delivery first counts itself in `chaos_execution` (autocommit, outside any transaction,
so a duplicate that OnceTask then skips is still counted). The OnceTask body writes one
`chaos_effect` row, inside the transaction that records its key in the inbox: effects applied
are counted from that table.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import django
from django.apps import apps
from django.db import Error, connection

# Upsert: a first execution inserts; every later one (a duplicate) counts up. An execution
# retrying its own insert (its commit's reply was lost in a restart) carries the same
# execution id and is not counted twice.
RECORD_SQL = """
INSERT INTO chaos_execution
    (task_id, scenario, deliveries, redeliveries, executed_at, last_executed_at,
     last_execution_id)
VALUES (%s, %s, 1, %s, clock_timestamp(), clock_timestamp(), %s)
ON CONFLICT (task_id) DO UPDATE
SET deliveries = chaos_execution.deliveries + 1,
    redeliveries = chaos_execution.redeliveries + EXCLUDED.redeliveries,
    last_executed_at = clock_timestamp(),
    last_execution_id = EXCLUDED.last_execution_id
WHERE chaos_execution.last_execution_id <> EXCLUDED.last_execution_id
"""
EFFECT_SQL = """
INSERT INTO chaos_effect (task_id, scenario, applied_at) VALUES (%s, %s, clock_timestamp())
"""
ATTEMPTS = 240  # bounded: a PostgreSQL restart mid-task is waited out, not a lost execution
RETRY_PAUSE = 0.25  # seconds


def record_execution(task_id: str, scenario: str, *, redelivered: bool) -> None:
    """Insert or count up this task id, retrying through a database outage."""
    if not apps.ready:
        django.setup()
    execution_id = uuid.uuid4().hex
    for attempt in range(ATTEMPTS):
        try:
            with connection.cursor() as cursor:
                cursor.execute(RECORD_SQL, [task_id, scenario, int(redelivered), execution_id])
            return
        except Error:
            connection.close()
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(RETRY_PAUSE)


def apply_effect(task_id: str, scenario: str) -> None:
    """The task's one effect: a row on the connection of the caller's transaction."""
    with connection.cursor() as cursor:
        cursor.execute(EFFECT_SQL, [task_id, scenario])


T = TypeVar("T")


def through_outages(action: Callable[[], T]) -> T:
    """Run `action` (a whole transaction) again after a database error, as often as needed.

    For OnceTask's delivery: a transaction cut by a PostgreSQL restart either committed (the
    next attempt finds the key and skips) or did not (the next attempt runs the body), so
    running it again is safe, and the effect is never left to a redelivery that would not come
    (the worker acknowledges a failed task).
    """
    for attempt in range(ATTEMPTS):
        try:
            return action()
        except Error:
            connection.close()
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(RETRY_PAUSE)
    raise AssertionError("unreachable")
