"""The two libraries under test, and how the benchmark talks to each one's table and relay.

A Side names a library's table, its relay command and how to fill its table. Rows are copies
of one row that the library's own write side produced (`task.delay()` inside `atomic()`), each
with a fresh task id, so relays publish exactly what they would publish in production.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from psycopg import sql

from bench.brokers import Broker
from bench.procs import Proc, Processes
from bench.services import Postgres
from bench.venv import ROOT

SETTINGS_MODULE = "bench.project.settings"

OURS_SELECT = """\
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, context, schema_version)
SELECT s.t, {task_name}, {args}::json, {kwargs}::json,
       replace({options}, {template_id}, s.t)::json, {context}::json, {schema_version}
FROM ({source}) AS s(t)"""
PEER_SELECT = """\
INSERT INTO celery_outbox
    (created_at, retries, task_id, task_name, args, kwargs, options, sentry_trace_id,
     sentry_baggage, structlog_context, schema_version)
SELECT now(), 0, s.t, {task_name}, {args}::jsonb, {kwargs}::jsonb, {options}::jsonb,
       {sentry_trace_id}, {sentry_baggage}, {structlog_context}, {schema_version}
FROM ({source}) AS s(t)"""
SERIES = "SELECT gen_random_uuid()::text FROM generate_series(1, {count})"
ONE = "VALUES ({task_id})"
SENTINEL = "__bench_task_id__"
PGBENCH_ONE = "SELECT gen_random_uuid()::text"


@dataclass(frozen=True, kw_only=True)
class Side:
    """One library under test."""

    key: str  # "ours" or "peer"
    label: str
    table: str
    alias: str  # Django alias of its database in bench.project.settings
    db_env: str
    queue_env: str
    command: tuple[str, ...]  # manage.py command and flags of its relay
    ready_marker: str  # what its relay logs once it is up
    insert_template: str
    template: dict[str, Any] | None = None  # one real row, filled in by load_template()
    # Another commit's code (bench.versus): its interpreter, the PYTHONPATH that gives it this
    # benchmark project, and its own database whatever the slot. None: this checkout's.
    python: Path | None = None
    path: Path | None = None
    database: str | None = None


OURS = Side(
    key="ours",
    label="outbox-notify",
    table="outbox_notify_message_v1",
    alias="ours",
    db_env="BENCH_OURS_DB",
    queue_env="BENCH_OURS_QUEUE",
    command=("outbox_listen",),
    ready_marker="outbox.database_connected",
    insert_template=OURS_SELECT,
)
PEER = Side(
    key="peer",
    label="django-celery-outbox 0.4.3",
    table="celery_outbox",
    alias="default",
    db_env="BENCH_PEER_DB",
    queue_env="BENCH_PEER_QUEUE",
    command=("celery_outbox_relay",),
    ready_marker="celery_outbox_relay_started",
    insert_template=PEER_SELECT,
)


@dataclass(frozen=True, kw_only=True)
class Slot:
    """Where a side's processes read and publish: its database and its queue's name."""

    ours_db: str
    peer_db: str
    ours_queue: str
    peer_queue: str

    def database(self, side: Side) -> str:
        if side.database:
            return side.database
        return self.ours_db if side.key == "ours" else self.peer_db

    def queue(self, side: Side) -> str:
        return self.ours_queue if side.key == "ours" else self.peer_queue


MAIN = Slot(
    ours_db="outbox_bench_ours",
    peer_db="outbox_bench_peer",
    ours_queue="bench-ours",
    peer_queue="bench-peer",
)


def crash_slot(broker: str) -> Slot:
    """The crash scenario's databases and queues for one broker (waits on them overlap)."""
    return Slot(
        ours_db=f"outbox_bench_ours_crash_{broker}",
        peer_db=f"outbox_bench_peer_crash_{broker}",
        # Ours routes by the queue stored in its template row: the same queue as MAIN (its
        # crash run is over before any other scenario starts and empties it).
        ours_queue="bench-ours",
        peer_queue="bench-peer-crash",
    )


@dataclass(frozen=True, kw_only=True)
class World:
    """Everything a scenario needs: services, process registry, sides and the environment.

    `broker` is the one the relays of this scenario publish to; `brokers` all of the run's.
    """

    pg: Postgres
    broker: Broker
    brokers: tuple[Broker, ...]
    procs: Processes
    sides: tuple[Side, ...]
    work_dir: Path
    quick: bool

    def on(self, broker: Broker) -> World:
        """The same world with its relays publishing to another broker."""
        return replace(self, broker=broker)

    def queue(self, side: Side, slot: Slot = MAIN) -> str:
        """The name of the side's queue on this world's broker."""
        return self.broker.queue(slot.queue(side))

    def env(self, slot: Slot = MAIN, **extra: str) -> dict[str, str]:
        """Environment of a process of the benchmark project."""
        params = self.pg.params
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
            "BENCH_PEER": "1" if any(s.key == "peer" for s in self.sides) else "0",
            "BENCH_DB_HOST": str(params.get("host") or "127.0.0.1"),
            "BENCH_DB_PORT": str(params.get("port") or "5432"),
            "BENCH_DB_USER": str(params.get("user") or "postgres"),
            "BENCH_DB_PASSWORD": str(params.get("password") or ""),
            "BENCH_OURS_DB": slot.ours_db,
            "BENCH_PEER_DB": slot.peer_db,
            "BENCH_OURS_QUEUE": self.broker.queue(slot.ours_queue),
            "BENCH_PEER_QUEUE": self.broker.queue(slot.peer_queue),
            "BENCH_BROKER_URL": self.broker.url,
            **extra,
        }

    def side_env(self, side: Side, slot: Slot = MAIN) -> dict[str, str]:
        """Environment of a process of the side's own code (its relay, its write side)."""
        if side.path is None:
            return self.env(slot)
        path, database = str(side.path), slot.database(side)
        # Its venv holds outbox_notify only, not the peer library.
        return self.env(slot, PYTHONPATH=path, BENCH_OURS_DB=database, BENCH_PEER="0")

    def dsn(self, side: Side, slot: Slot = MAIN) -> str:
        return self.pg.dsn(slot.database(side))

    def start_relay(self, side: Side, slot: Slot = MAIN, name: str = "") -> Proc:
        """Start one relay of a side with its default flags."""
        argv = [str(side.python or sys.executable), "-m", "django", *side.command]
        env = self.side_env(side, slot)
        # `-m` puts the working directory first on sys.path: another commit's relay must not
        # start in this checkout, whose outbox_notify would shadow its own.
        return self.procs.start(name or f"relay-{side.key}", argv, env, cwd=side.path)

    def start_relays(self, side: Side, count: int, slot: Slot = MAIN) -> list[Proc]:
        """Start `count` relays and wait until each one is up."""
        relays = [self.start_relay(side, slot, f"relay-{side.key}-{i}") for i in range(count)]
        for relay in relays:
            relay.wait_for_output(side.ready_marker)
        return relays

    def worker(self, name: str, args: list[str], slot: Slot = MAIN) -> Proc:
        """Start `python -m bench.workers ARGS`."""
        argv = [sys.executable, "-m", "bench.workers", *args]
        return self.procs.start(name, argv, self.env(slot))


def with_template(side: Side, template: dict[str, Any]) -> Side:
    return replace(side, template=template)


def template_from_output(text: str) -> dict[str, Any]:
    """The JSON line a `bench.workers template` run printed last."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            loaded: dict[str, Any] = json.loads(line)
            return loaded
    raise ValueError(f"no template row in the worker's output:\n{text}")


def insert_sql(side: Side, source: sql.Composable) -> sql.Composed:
    """INSERT ... SELECT of the template row for every task id `source` yields."""
    assert side.template is not None, "load the template first"
    values = {k: sql.Literal(v) for k, v in side.template.items() if k != "task_id"}
    values["template_id"] = sql.Literal(side.template["task_id"])
    return sql.SQL(side.insert_template).format(source=source, **values)


def fill_sql(side: Side, count: int) -> sql.Composed:
    """INSERT of `count` rows, each with a fresh task id."""
    return insert_sql(side, sql.SQL(SERIES).format(count=sql.Literal(count)))


def one_row_sql(side: Side) -> str:
    """INSERT of one row whose task id is the %(task_id)s parameter, as query text."""
    text = insert_sql(side, sql.SQL(ONE).format(task_id=sql.Literal(SENTINEL))).as_string(None)
    # The template's literals are inlined: double their % so only the placeholder remains.
    return text.replace("%", "%%").replace(f"'{SENTINEL}'", "%(task_id)s")


def pgbench_script(side: Side) -> str:
    """A pgbench script inserting one row (fresh task id) per transaction."""
    return insert_sql(side, sql.SQL(PGBENCH_ONE)).as_string(None) + ";\n"
