"""What the chaos task runs inside the worker: one upsert into the execution ledger."""

from __future__ import annotations

import time
import uuid

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
