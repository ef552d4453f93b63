"""Events consumed per second by one events Consumer with its inbox, on RabbitMQ and Redis.

Run: .venv/bin/python -m bench.consume [--events 2000] [--rounds 3] [--quick] [--dsn URL]
                                       [--brokers rabbitmq,redis] [--json PATH]

Each round publishes --events CloudEvents messages to a fresh durable topic exchange and queue
first (exactly as the relay publishes them), then one Consumer (the Runner `outbox_consume`
runs, in this process) handles them: each handler inserts one row, inside the transaction that
also records the event (its source and id) in the inbox. The figure is events per second between the first and
the last commit (stamped by `transaction.on_commit`), so start-up and publishing are not in it.
After each round every event must have left exactly one row and one inbox key.

Brokers: RabbitMQ at OUTBOX_BENCH_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672//) and
Redis at OUTBOX_BENCH_REDIS_URL (default redis://127.0.0.1:6379/11). PostgreSQL: a private
durable server (fsync and synchronous_commit on), or the server of --dsn /
OUTBOX_TEST_DATABASE_URL, where a database of its own is created and dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kombu
import psycopg
import structlog
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from devtools import pgserver
from outbox_notify import sql as sql_files

BROKERS = {
    "rabbitmq": os.environ.get("OUTBOX_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    "redis": os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11"),
}
DURABLE = "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c max_connections=50"
PUBLISH_BATCH = 500  # messages per connection when staging a round


@dataclasses.dataclass(frozen=True)
class Tick:
    """The benchmark's event: one sequence number."""

    event_type = "bench.Tick"
    seq: int


@dataclasses.dataclass(kw_only=True)
class Round:
    """One round on one broker: how many events, first and last commit (monotonic seconds)."""

    broker: str
    events: int
    first: float = 0.0
    last: float = 0.0
    committed: int = 0

    @property
    def per_second(self) -> float:
        return (self.events - 1) / (self.last - self.first)


# --- PostgreSQL and Django ---------------------------------------------------------------------


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """A fresh database holding the outbox schema and the effect table; its conninfo."""
    with contextlib.ExitStack() as stack:
        server = dsn or stack.enter_context(pgserver.running(DURABLE)).url()
        name = f"outbox_bench_consume_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
        try:
            url = make_conninfo(server, dbname=name)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql_files.read("install.sql"))
                conn.execute(
                    "CREATE TABLE consume_bench_effect (id bigserial PRIMARY KEY, seq int)"
                )
            yield url
        finally:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(
                    pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        pgsql.Identifier(name)
                    )
                )


def configure_django(url: str) -> None:
    """Settings for this process: the bench database as the outbox database, nothing else."""
    import django
    from django.conf import settings

    params = conninfo_to_dict(url)
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": str(params.get("dbname")),
                "USER": str(params.get("user", "postgres")),
                "PASSWORD": str(params.get("password", "")),
                "HOST": str(params.get("host", "127.0.0.1")),
                "PORT": str(params.get("port", "5432")),
                "CONN_MAX_AGE": None,
            }
        },
        INSTALLED_APPS=["outbox_notify"],
        USE_TZ=True,
    )
    django.setup()


def counts(url: str, scope: str) -> tuple[int, int]:
    """Rows in the effect table, inbox keys of the scope."""
    with psycopg.connect(url, autocommit=True) as conn:
        effects = conn.execute("SELECT count(*) FROM consume_bench_effect").fetchone()
        keys = conn.execute(
            "SELECT count(*) FROM outbox_notify_inbox_v1 WHERE scope = %s", [scope]
        ).fetchone()
    return int(effects[0] if effects else 0), int(keys[0] if keys else 0)


# --- one round ---------------------------------------------------------------------------------


def stage(url: str, exchange: str, events: int) -> None:
    """Publish the round's events as the relay does (body, headers, persistent, topic exchange)."""
    from outbox_notify.events import envelope as wire

    target = kombu.Exchange(exchange, type="topic", durable=True)
    for start in range(0, events, PUBLISH_BATCH):
        with kombu.Connection(url) as connection:
            producer = kombu.Producer(connection.default_channel)
            for seq in range(start, min(events, start + PUBLISH_BATCH)):
                envelope = wire.Envelope(
                    id=wire.new_event_id(),
                    source="/bench",
                    type=Tick.event_type,
                    time=datetime.now(UTC),
                    data={"seq": seq},
                )
                producer.publish(
                    wire.encode(envelope),
                    exchange=target,
                    routing_key=envelope.type,
                    headers=wire.binding_headers(envelope),
                    content_type=wire.CONTENT_TYPE,
                    content_encoding="utf-8",
                    delivery_mode=2,
                    declare=[target],  # kombu's Redis routes only through exchanges it declared
                    retry=False,
                )


def one_round(db_url: str, broker: str, events: int) -> Round:
    """Stage the events, consume them all with one consumer, check every one left one row."""
    from django.db import connection, transaction

    from outbox_notify.events import Consumer
    from outbox_notify.events.delivery import Runner, declare

    url, tag = BROKERS[broker], uuid.uuid4().hex[:8]
    consumer = Consumer(f"bench-{tag}", exchange=f"bench-x-{tag}", broker_url=url, prefetch=64)
    result = Round(broker=broker, events=events)
    runner = Runner(consumer)

    def committed() -> None:
        now = time.monotonic()
        result.first = result.first or now
        result.last, result.committed = now, result.committed + 1
        if result.committed == events:
            runner.request_stop()

    @consumer.handler(Tick)
    def tick(event: Tick) -> None:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO consume_bench_effect (seq) VALUES (%s)", [event.seq])
        transaction.on_commit(committed)

    with kombu.Connection(url) as conn:
        declare(consumer, conn.default_channel)
    try:
        before, _ = counts(db_url, consumer.scope)
        stage(url, consumer.exchange, events)
        runner.run()
        after, keys = counts(db_url, consumer.scope)
    finally:
        remove(url, consumer)
    if (after - before, keys) != (events, events):
        raise SystemExit(f"{broker}: {after - before} rows and {keys} keys for {events} events")
    return result


def remove(url: str, consumer: Any) -> None:
    """Delete the round's queues and exchanges."""
    with kombu.Connection(url) as connection:
        channel = connection.default_channel
        for name in (consumer.queue, consumer.dead_letter_exchange):
            kombu.Queue(name, channel=channel).delete()
        for name in (consumer.exchange, consumer.dead_letter_exchange):
            kombu.Exchange(name, type="topic", channel=channel).delete()


# --- report ------------------------------------------------------------------------------------


def summarise(rounds: list[Round]) -> dict[str, Any]:
    """Median events per second per broker, and every round's figure."""
    out: dict[str, Any] = {}
    for broker in sorted({r.broker for r in rounds}):
        rates = [r.per_second for r in rounds if r.broker == broker]
        out[broker] = {
            "events_per_second": statistics.median(rates),
            "rounds": rates,
            "events": rounds[0].events,
        }
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a run's figures."""
    lines = [
        "One `outbox_consume` runner in-process, its handler writing one row, the event's "
        "source and id recorded in the inbox in the same transaction (one commit per event; PostgreSQL with "
        "fsync on); events staged in the queue first (`python -m bench.consume`).",
        "",
        "| broker | events consumed/s (median) | rounds | events per round |",
        "|---|---|---|---|",
    ]
    for broker, fig in summary.items():
        each = ", ".join(f"{rate:.0f}" for rate in fig["rounds"])
        lines.append(f"| {broker} | {fig['events_per_second']:.0f} | {each} | {fig['events']:,} |")
    return "\n".join(lines)


def print_report(summary: dict[str, Any]) -> None:
    print("events consumed per second, one consumer, inbox + one row per event (median)")
    for broker, figures in summary.items():
        each = ", ".join(f"{rate:.0f}" for rate in figures["rounds"])
        print(f"  {broker:<9} {figures['events_per_second']:>8.0f} /s   rounds: {each}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.consume",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--events", type=int, default=2000, help="events per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="300 events, 1 round")
    parser.add_argument("--brokers", default="rabbitmq,redis")
    parser.add_argument("--dsn", default=os.environ.get("OUTBOX_TEST_DATABASE_URL"))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    # Per-event debug lines would be most of what is measured: warnings and errors only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    events, rounds = (300, 1) if args.quick else (args.events, args.rounds)
    brokers = [name.strip() for name in args.brokers.split(",") if name.strip()]
    with database(args.dsn) as url:
        configure_django(url)
        # Alternate the brokers round by round, so both meet the same machine load.
        results = [one_round(url, b, events) for _ in range(rounds) for b in brokers]
    summary = summarise(results)
    print_report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
