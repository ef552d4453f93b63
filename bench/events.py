"""Domain events published per second through one relay, into RabbitMQ and into Redis.

Run: .venv/bin/python -m bench.events [--events 20000] [--rounds 3] [--brokers rabbitmq,redis]
                                      [--quick] [--json PATH]

Starts a private PostgreSQL with sql/install.sql and, per broker, one real `outbox_listen`
(default flags). Each round commits --events events in one transaction, written by
`outbox_notify.events.publish` exactly as an application writes them (a dataclass event with a
few fields, to a durable topic exchange with one queue bound to "#"), and times from the
COMMIT until the last one is in the broker's queue. The same is done for as many Celery
tasks (`add.apply_async`) through the same relay, alternated with the events, for comparison.
Prints the medians in messages/s, and what publish() costs the writer per event.

Brokers: OUTBOX_BENCH_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672//) and
OUTBOX_BENCH_REDIS_URL (default redis://127.0.0.1:6379/12); OUTBOX_BENCH_EVENTS_NAME names the
exchange and queues (default outbox-bench-events), all removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from devtools import pgserver
from outbox_notify import sql

ROOT = Path(__file__).resolve().parent.parent
AMQP_URL = os.environ.get("OUTBOX_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
# The exchange and its queue; tasks go to NAME-tasks. Tests give each run its own name.
NAME = os.environ.get("OUTBOX_BENCH_EVENTS_NAME", "outbox-bench-events")
EXCHANGE = QUEUE = NAME
TASK_QUEUE = f"{NAME}-tasks"
DRAIN_DEADLINE = 600.0  # seconds one round may take before the benchmark gives up


@dataclasses.dataclass(frozen=True)
class OrderPlaced:
    """The benchmark's event: a few fields, as a typical integration event has."""

    order_id: int
    customer: str
    total_cents: int
    lines: list[dict[str, Any]]


class Broker:
    """Sets up the bound queues on one broker and counts what arrived."""

    name = ""
    url = ""

    def setup(self) -> None: ...
    def count(self, queue: str) -> int: ...
    def purge(self) -> None: ...
    def teardown(self) -> None: ...


class Rabbit(Broker):
    """RabbitMQ through py-amqp: a durable topic exchange, a durable queue bound to '#'."""

    name, url = "rabbitmq", AMQP_URL

    def setup(self) -> None:
        import amqp

        parts = urlsplit(self.url)
        self.conn = amqp.Connection(
            f"{parts.hostname}:{parts.port or 5672}",
            userid=parts.username or "guest",
            password=parts.password or "guest",
        )
        self.conn.connect()
        self.channel = self.conn.channel()
        self.channel.exchange_declare(EXCHANGE, "topic", durable=True, auto_delete=False)
        for queue in (QUEUE, TASK_QUEUE):
            self.channel.queue_declare(queue, durable=True, auto_delete=False)
        self.channel.queue_bind(QUEUE, EXCHANGE, "#")

    def count(self, queue: str) -> int:
        return int(self.channel.queue_declare(queue, passive=True).message_count)

    def purge(self) -> None:
        for queue in (QUEUE, TASK_QUEUE):
            self.channel.queue_purge(queue)

    def teardown(self) -> None:
        for queue in (QUEUE, TASK_QUEUE):
            self.channel.queue_delete(queue)
        self.channel.exchange_delete(EXCHANGE)
        self.conn.close()


class Redis(Broker):
    """Redis through kombu's topic emulation: the queue bound to the exchange with '#'."""

    name, url = "redis", REDIS_URL

    def setup(self) -> None:
        import redis
        from kombu import Connection, Exchange, Queue

        self.client = redis.Redis.from_url(self.url)
        self.teardown_keys()
        with Connection(self.url) as conn:
            exchange = Exchange(EXCHANGE, type="topic", durable=True)
            Queue(QUEUE, exchange, routing_key="#")(conn.default_channel).declare()

    def count(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def purge(self) -> None:
        self.client.delete(QUEUE, TASK_QUEUE)

    def teardown_keys(self) -> None:
        for key in self.client.keys(f"*{NAME}*"):
            self.client.delete(key)

    def teardown(self) -> None:
        self.teardown_keys()
        self.client.close()


def _django(url: str, broker_url: str) -> None:
    """Set up Django in this process on the private server (the writer side of the bench)."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        OUTBOX_TEST_DATABASE_URL=url,
        OUTBOX_TEST_DB_NAME="postgres",
        OUTBOX_TEST_BROKER_URL=broker_url,
    )
    import django

    django.setup()


def _relay_env(url: str, broker_url: str) -> dict[str, str]:
    return dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        OUTBOX_TEST_DATABASE_URL=url,
        OUTBOX_TEST_DB_NAME="postgres",
        OUTBOX_TEST_BROKER_URL=broker_url,
        PYTHONPATH=str(ROOT),
    )


@contextmanager
def _relay(url: str, broker_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "outbox_listen"],
        env=_relay_env(url, broker_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def write_events(count: int, start: int) -> float:
    """Commit `count` events in one transaction; the seconds publish() calls took."""
    from django.db import transaction

    from outbox_notify import events

    lines = [{"sku": "A-100", "qty": 2, "cents": 1250}]
    with transaction.atomic():
        began = time.perf_counter()
        for n in range(start, start + count):
            event = OrderPlaced(order_id=n, customer=f"c-{n % 97}", total_cents=2500, lines=lines)
            events.publish(event, exchange=EXCHANGE)
        return time.perf_counter() - began


def write_tasks(count: int, start: int) -> float:
    """Commit `count` Celery tasks in one transaction; the seconds apply_async took."""
    from django.db import transaction

    from tests.celery_app import add

    with transaction.atomic():
        began = time.perf_counter()
        for n in range(start, start + count):
            add.apply_async((n, 1), queue=TASK_QUEUE)
        return time.perf_counter() - began


def _drain(
    broker: Broker, queue: str, count: int, write: Callable[[int, int], float]
) -> tuple[float, float]:
    """(messages/s from COMMIT to the last arrival, writer µs per call) for one round."""
    broker.purge()
    write_seconds = write(count, int(time.time() * 1000) % 10**9)
    committed = time.monotonic()  # write() returned: its COMMIT is done
    while broker.count(queue) < count:
        if time.monotonic() - committed > DRAIN_DEADLINE:
            raise SystemExit(f"{broker.name}: only {broker.count(queue)} of {count} arrived")
        time.sleep(0.005)
    return count / (time.monotonic() - committed), write_seconds / count * 1e6


def measure(broker: Broker, url: str, count: int, rounds: int) -> dict[str, Any]:
    """Events and tasks through one relay on this broker, alternated round by round."""
    rates: dict[str, list[float]] = {"events": [], "tasks": []}
    writer_us: list[float] = []
    broker.setup()
    try:
        with _relay(url, broker.url):
            _drain(broker, QUEUE, min(count, 500), write_events)  # warm-up: connect, declare
            _drain(broker, TASK_QUEUE, min(count, 500), write_tasks)
            for round_no in range(rounds):
                order = ("events", "tasks") if round_no % 2 == 0 else ("tasks", "events")
                for kind in order:
                    if kind == "events":
                        rate, us = _drain(broker, QUEUE, count, write_events)
                        writer_us.append(us)
                    else:
                        rate, _ = _drain(broker, TASK_QUEUE, count, write_tasks)
                    rates[kind].append(rate)
    finally:
        broker.teardown()
    return {
        "events_per_second": statistics.median(rates["events"]),
        "tasks_per_second": statistics.median(rates["tasks"]),
        "publish_call_us": statistics.median(writer_us),
        "runs": {k: [round(r) for r in v] for k, v in rates.items()},
    }


def main(argv: list[str] | None = None) -> None:
    """Measure and print events (and tasks) per second through one relay, per broker."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="events per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--brokers", default="rabbitmq,redis", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="500 events, 1 round")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.events, args.rounds = 500, 1
    brokers = {"rabbitmq": Rabbit(), "redis": Redis()}
    chosen = [brokers[name.strip()] for name in args.brokers.split(",") if name.strip()]
    print("(figures from a shared machine are indicative: re-measure on a quiet one)")
    with pgserver.running() as server:
        url = server.url()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.read("install.sql"))
        _django(url, chosen[0].url)
        results: dict[str, Any] = {}
        for broker in chosen:
            figures = measure(broker, url, args.events, args.rounds)
            print(
                f"{broker.name}: {figures['events_per_second']:,.0f} events/s through one relay "
                f"(tasks: {figures['tasks_per_second']:,.0f}/s), median of {args.rounds} rounds "
                f"of {args.events:,}; publish() {figures['publish_call_us']:.0f} µs per event "
                "in the writer"
            )
            print("  runs (msg/s):", figures["runs"])
            results[broker.name] = figures
    if args.json:
        summary = {"events": args.events, "rounds": args.rounds, "brokers": results}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


def markdown(summary: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a run's figures."""
    lines = [
        f"One relay (default flags), {summary['events']:,} events per round committed in one "
        f"transaction through `events.publish()`, medians of {summary['rounds']} round(s), "
        "alternated with as many Celery tasks through the same relay (`python -m bench.events`).",
        "",
        "| broker | events/s through one relay | tasks/s, same relay | `publish()` µs per event in the writer |",
        "|---|---|---|---|",
    ]
    for name, fig in summary["brokers"].items():
        lines.append(
            f"| {name} | {fig['events_per_second']:,.0f} | {fig['tasks_per_second']:,.0f} | "
            f"{fig['publish_call_us']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
