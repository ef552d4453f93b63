"""The bench.once worker's Celery app: the same bodies as plain tasks and as OnceTasks.

`*_noop` do nothing; `*_row` insert one row. `plain_row_atomic` wraps its insert in
transaction.atomic() as a careful plain task would. `mark` stamps CLOCK_MONOTONIC into the
BENCH_ONCE_MARKS file, so the benchmark times a block of tasks from inside the worker.
"""

from __future__ import annotations

import os
import time

from django.db import connection, transaction

from outbox_notify import OnceTask, OutboxCelery

INSERT = "INSERT INTO once_bench_effect (seq) VALUES (%s)"

app = OutboxCelery("bench_once")
app.conf.update(
    broker_url=os.environ.get("BENCH_ONCE_REDIS_URL", "redis://127.0.0.1:6379/11"),
    task_default_queue=os.environ.get("BENCH_ONCE_QUEUE", "bench-once"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    enable_utc=True,
)
# Celery's Django fixup closes every database connection before and after each task unless
# CELERY_DB_REUSE_MAX is set (then it recycles them every that many tasks). The benchmark
# measures both: Celery's default (0, a new connection per task) and reuse.
if int(os.environ.get("BENCH_ONCE_DB_REUSE_MAX", "0")):
    app.conf.CELERY_DB_REUSE_MAX = int(os.environ["BENCH_ONCE_DB_REUSE_MAX"])


def _insert(seq: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(INSERT, [seq])


@app.task(name="once_bench.plain_noop")
def plain_noop(seq: int) -> None:
    """Nothing at all."""


@app.task(name="once_bench.once_noop", base=OnceTask)
def once_noop(seq: int) -> None:
    """Nothing at all, once."""


@app.task(name="once_bench.plain_row")
def plain_row(seq: int) -> None:
    """One row, in autocommit (what most plain tasks do)."""
    _insert(seq)


@app.task(name="once_bench.plain_row_atomic")
def plain_row_atomic(seq: int) -> None:
    """One row, inside transaction.atomic()."""
    with transaction.atomic():
        _insert(seq)


@app.task(name="once_bench.once_row", base=OnceTask)
def once_row(seq: int) -> None:
    """One row, once (OnceTask's own transaction)."""
    _insert(seq)


@app.task(name="once_bench.mark")
def mark(label: str) -> None:
    """Append `label monotonic_ns` to the marks file."""
    with open(os.environ["BENCH_ONCE_MARKS"], "a", encoding="utf-8") as handle:
        handle.write(f"{label} {time.monotonic_ns()}\n")
