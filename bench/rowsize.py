"""Stored bytes per message: the outbox row, and the WAL its insert writes.

Run: .venv/bin/python -m bench.rowsize [--messages 2000] [--quick] [--json PATH]

Starts a private PostgreSQL (WAL is counted for the whole cluster, so nothing else may write
to it; autovacuum off and no checkpoint during the run, full-page writes on as in
production), installs sql/install.sql, and writes each case through the real write side:
--messages messages one per transaction (as a web request does), then as many 100 per
transaction, each after a warm-up of its own. Per case it prints:

- row bytes: `pg_column_size(t.*)` of the stored rows of `outbox_notify_message_v1` (the
  whole row as PostgreSQL stores it, tuple header included), and of `options` alone;
- WAL bytes per message: `pg_current_wal_lsn()` before and after the inserts, divided by
  their number (the heap and index records, and one COMMIT per transaction).

The cases: a one-argument task with default options (`delay(42)` on an app routing to its
default queue); a task with several options (countdown, expires, priority, a custom header,
its own queue, time limits, a link); a domain event (`events.publish` of a small dataclass).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

MESSAGES = 2_000  # messages per measurement
QUICK_MESSAGES = 200
WARMUP = 200  # messages written (and kept) before each measurement, so its pages exist
PER_TRANSACTION = (1, 100)
# A cluster of its own: nothing but the benchmark writes WAL, and nothing interrupts it.
SERVER_OPTIONS = "-c fsync=off -c autovacuum=off -c checkpoint_timeout=1h -c max_wal_size=8GB"


@dataclasses.dataclass(frozen=True)
class OrderPlaced:
    """The domain event case: a few fields, as a typical integration event has."""

    order_id: int
    customer: str
    total_cents: int


def _django(url: str) -> Any:
    """Django in this process on the private server; the benchmark's own Celery app."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        OUTBOX_TEST_DATABASE_URL=url,
        OUTBOX_TEST_DB_NAME="postgres",
    )
    import django

    django.setup()
    from outbox_notify import OutboxCelery

    # Celery's defaults (queue "celery"), as an application that configured no routing has.
    app = OutboxCelery("rowsize", set_as_current=False)
    app.conf.update(broker_url="memory://", enable_utc=True)
    return app


def cases(app: Any) -> dict[str, Callable[[int], Any]]:
    """Each case: a call that writes one message, given a sequence number."""
    from outbox_notify import events

    @app.task(name="shop.tasks.send_receipt")
    def send_receipt(order_id: int) -> None:
        """The one-argument task."""

    @app.task(name="shop.tasks.audit")
    def audit(*args: Any) -> None:
        """The task linked as a callback."""

    def default(n: int) -> Any:
        return send_receipt.delay(n)

    def several(n: int) -> Any:
        return send_receipt.apply_async(
            (n,),
            countdown=60,
            expires=3600,
            priority=5,
            headers={"x-tenant": "acme"},
            queue="emails",
            time_limit=30,
            soft_time_limit=20,
            link=audit.s(),
        )

    def event(n: int) -> Any:
        return events.publish(
            OrderPlaced(order_id=n, customer=f"c-{n % 97}", total_cents=2500), exchange="shop"
        )

    return {
        "task, one argument, default options": default,
        "task, several options": several,
        "domain event": event,
    }


def _wal_lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def _wal_since(conn: psycopg.Connection[Any], lsn: str) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [lsn]).fetchone()
    assert row is not None
    return int(row[0])


def _write(call: Callable[[int], Any], count: int, per_transaction: int, start: int) -> None:
    from django.db import transaction

    for first in range(start, start + count, per_transaction):
        with transaction.atomic():
            for n in range(first, min(first + per_transaction, start + count)):
                call(n)


def _row_bytes(conn: psycopg.Connection[Any]) -> tuple[float, float]:
    row = conn.execute(
        "SELECT avg(pg_column_size(t.*)), avg(pg_column_size(t.options))"
        " FROM outbox_notify_message_v1 AS t"
    ).fetchone()
    assert row is not None
    return float(row[0]), float(row[1])


def measure(
    conn: psycopg.Connection[Any], call: Callable[[int], Any], count: int
) -> dict[str, Any]:
    """Row bytes and WAL bytes per message of one case."""
    conn.execute("TRUNCATE outbox_notify_message_v1")
    wal: dict[str, float] = {}
    start = 0
    for per_transaction in PER_TRANSACTION:
        _write(call, WARMUP, per_transaction, start)
        start += WARMUP
        lsn = _wal_lsn(conn)
        _write(call, count, per_transaction, start)
        wal[str(per_transaction)] = _wal_since(conn, lsn) / count
        start += count
    row, options = _row_bytes(conn)
    return {"row_bytes": row, "options_bytes": options, "wal_bytes_per_message": wal}


def run(count: int) -> dict[str, Any]:
    """Every case on a private server; the figures."""
    from devtools import pgserver
    from outbox_notify import sql

    with pgserver.running(SERVER_OPTIONS) as server:
        url = server.url()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.read("install.sql"))
            app = _django(url)
            figures = {name: measure(conn, call, count) for name, call in cases(app).items()}
    return {"messages": count, "per_transaction": list(PER_TRANSACTION), "cases": figures}


def _lines(summary: dict[str, Any]) -> list[str]:
    lines = [
        "| message | row bytes (`pg_column_size(t.*)`) | of which `options` "
        "| WAL bytes per message, 1 per transaction | 100 per transaction |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, fig in summary["cases"].items():
        wal = fig["wal_bytes_per_message"]
        lines.append(
            f"| {name} | {fig['row_bytes']:,.0f} | {fig['options_bytes']:,.0f} "
            f"| {wal['1']:,.0f} | {wal['100']:,.0f} |"
        )
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a run's figures."""
    intro = (
        f"What one message stores in `outbox_notify_message_v1`, averaged over "
        f"{summary['messages']:,} messages written through the real write side on a private "
        "PostgreSQL (`python -m bench.rowsize`). The WAL figure is `pg_current_wal_lsn()` "
        "before and after, divided by the messages: what replicas replay and backups carry."
    )
    return "\n".join([intro, "", *_lines(summary)])


def main(argv: list[str] | None = None) -> None:
    """Measure and print the bytes of each case."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=MESSAGES, help="messages per measurement")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MESSAGES} messages")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.messages = QUICK_MESSAGES
    summary = run(args.messages)
    print("\n".join(_lines(summary)))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
