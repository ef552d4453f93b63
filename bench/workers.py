"""Processes the benchmark runs beside the relays: `python -m bench.workers COMMAND ...`.

    template  --side S                     one real row from the library's write side (JSON)
    produce   --dsn D --sql F --rate R ... commit rows at a fixed rate (--per-tx K per transaction)
    consume   --url U --queue Q --out F    take each message off the broker, stamp its arrival
    enqueue   --side S --per-tx K ...      task.delay() inside atomic(): rows per second
    ceiling   --count N --template F       plain Celery send_task, and our publish path alone
                                           (to the broker BENCH_BROKER_URL names)

Times are time.monotonic_ns(): CLOCK_MONOTONIC is one clock for every process on the
machine, so a commit stamped by the producer and an arrival stamped by the consumer compare.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis

POP_BATCH = 1000  # messages fetched per RPOP once BRPOP found one
BRPOP_TIMEOUT = 0.2  # seconds: how often the consumer checks whether it should stop
PREFETCH = 1000  # RabbitMQ: deliveries in flight to the consumer (no acks: taken as sent)
WARMUP_CALLS = 20  # delay() calls before timing (imports, prepared statements)
PUBLISH_BATCH = 100  # the relay's default --batch-size


def _django() -> None:
    import django

    django.setup()


def _task(side: str) -> tuple[Any, str]:
    from bench.project.benchapp import tasks

    return (tasks.ours_noop, "ours") if side == "ours" else (tasks.peer_noop, "default")


# --- template ---------------------------------------------------------------------------

TEMPLATE_QUERIES = {
    "ours": "SELECT task_id, task_name, args::text, kwargs::text, options::text, context::text,"
    " schema_version FROM outbox_notify_message_v1 ORDER BY id DESC LIMIT 1",
    "peer": "SELECT task_id, task_name, args::text, kwargs::text, options::text, sentry_trace_id,"
    " sentry_baggage, structlog_context, schema_version FROM celery_outbox ORDER BY id DESC LIMIT 1",
}
TEMPLATE_DELETES = {
    "ours": "DELETE FROM outbox_notify_message_v1",
    "peer": "DELETE FROM celery_outbox",
}


def template(args: argparse.Namespace) -> None:
    """Write one message through the library's write side, print its row, delete it."""
    _django()
    from django.db import connections, transaction

    task, alias = _task(args.side)
    with transaction.atomic(using=alias):
        task.delay(seq=0, payload="x" * 16)
        with connections[alias].cursor() as cursor:
            cursor.execute(TEMPLATE_QUERIES[args.side])
            names = [c.name for c in cursor.description]
            row = dict(zip(names, cursor.fetchone(), strict=True))
            cursor.execute(TEMPLATE_DELETES[args.side])
    print(json.dumps(row))


# --- produce ----------------------------------------------------------------------------


class Schedule:
    """Message i is due at start + i / rate; threads take the next index in turn."""

    def __init__(self, rate: float, seconds: float) -> None:
        self.rate = rate
        self.total = max(1, int(rate * seconds))
        self.start = time.monotonic() + 0.2
        self.counter = itertools.count()
        self.lock = threading.Lock()

    def next_due(self) -> float | None:
        with self.lock:
            index = next(self.counter)
        return None if index >= self.total else self.start + index / self.rate


def _produce_thread(
    dsn: str, query: str, schedule: Schedule, per_tx: int, out: list[list[Any]]
) -> None:
    with psycopg.connect(dsn, autocommit=False) as conn:
        while (due := schedule.next_due()) is not None:
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            task_ids = [str(uuid.uuid4()) for _ in range(per_tx)]
            for task_id in task_ids:
                conn.execute(query, {"task_id": task_id})
            conn.commit()
            committed = time.monotonic_ns()
            out.extend([task_id, int(due * 1e9), committed] for task_id in task_ids)


def produce(args: argparse.Namespace) -> None:
    """Commit --rate rows per second (--per-tx per transaction) for --seconds, --threads connections."""
    query = Path(args.sql).read_text()
    schedule = Schedule(args.rate / args.per_tx, args.seconds)
    records: list[list[Any]] = []
    threads = [
        threading.Thread(
            target=_produce_thread, args=(args.dsn, query, schedule, args.per_tx, records)
        )
        for _ in range(args.threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ended = time.monotonic()
    Path(args.out).write_text(
        json.dumps({"records": records, "seconds": ended - schedule.start, "target": args.rate})
    )


# --- consume ----------------------------------------------------------------------------


def _task_id(raw: bytes) -> str:
    return str(json.loads(raw)["headers"]["id"])


def _pop_redis(
    url: str, queue: str, stop: threading.Event, keep: Callable[[bytes], Any] = bytes
) -> list[tuple[int, Any]]:
    """BRPOP the list (then RPOP what else is there) until `stop`; (arrival, keep(body)) pairs.

    keep=bytes defers parsing until the end (the hot loop stays cheap); a long run keeps
    only the task ids (_task_id), or every body would stay in memory.
    """
    client = redis.Redis.from_url(url)
    seen: list[tuple[int, Any]] = []
    print("consumer.ready", flush=True)
    while not stop.is_set():
        popped = client.brpop([queue], timeout=BRPOP_TIMEOUT)
        if popped is None:
            continue
        now = time.monotonic_ns()
        seen.append((now, keep(popped[1])))
        more = client.rpop(queue, POP_BATCH) or []
        now = time.monotonic_ns()
        seen.extend((now, keep(raw)) for raw in more)
    return seen


def _consume_amqp(url: str, queue: str, stop: threading.Event) -> list[tuple[int, str]]:
    """basic.consume the queue (no acks) until `stop`; (arrival, task id) pairs."""
    import socket

    from bench.brokers import amqp_connection

    conn = amqp_connection(url)
    channel = conn.channel()
    channel.basic_qos(0, PREFETCH, False)
    seen: list[tuple[int, str]] = []

    def arrived(message: Any) -> None:
        headers = message.properties.get("application_headers") or {}
        seen.append((time.monotonic_ns(), str(headers.get("id"))))

    channel.basic_consume(queue, no_ack=True, callback=arrived)
    print("consumer.ready", flush=True)
    try:
        while not stop.is_set():
            with contextlib.suppress(socket.timeout, TimeoutError):
                conn.drain_events(timeout=BRPOP_TIMEOUT)
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    return seen


def consume(args: argparse.Namespace) -> None:
    """Take messages off the queue until SIGTERM; write {task_id: arrival_ns} and duplicates."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.url.startswith(("amqp://", "pyamqp://")):
        seen = _consume_amqp(args.url, args.queue, stop)
    elif args.ids_only:
        seen = _pop_redis(args.url, args.queue, stop, _task_id)
    else:
        seen = [(stamp, _task_id(raw)) for stamp, raw in _pop_redis(args.url, args.queue, stop)]
    arrivals: dict[str, int] = {}
    for stamp, task_id in seen:
        arrivals.setdefault(task_id, stamp)
    Path(args.out).write_text(
        json.dumps({"arrivals": arrivals, "duplicates": len(seen) - len(arrivals)})
    )


# --- enqueue ----------------------------------------------------------------------------


def _enqueue_for(task: Any, alias: str, per_tx: int, seconds: float) -> tuple[int, float]:
    from django.db import transaction

    rows, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        with transaction.atomic(using=alias):
            for _ in range(per_tx):
                task.delay(seq=rows, payload="x" * 16)
                rows += 1
    return rows, time.perf_counter() - started


def enqueue(args: argparse.Namespace) -> None:
    """Rows per second through task.delay() inside atomic(), for each --per-tx batch size."""
    _django()
    from django.db import transaction

    task, alias = _task(args.side)
    for _ in range(WARMUP_CALLS):  # imports, connection, prepared statements
        with transaction.atomic(using=alias):
            task.delay(seq=-1, payload="x" * 16)
    results = []
    for per_tx in (int(n) for n in args.per_tx.split(",")):
        rows, seconds = _enqueue_for(task, alias, per_tx, args.seconds)
        results.append(
            {
                "per_transaction": per_tx,
                "rows": rows,
                "seconds": seconds,
                "rows_per_s": rows / seconds,
            }
        )
    print(json.dumps(results))


# --- ceiling ----------------------------------------------------------------------------


def _rate(count: int, seconds: float) -> dict[str, float]:
    return {
        "messages": count,
        "seconds": seconds,
        "per_s": count / seconds,
        "us_per_message": seconds / count * 1e6,
    }


def _plain_send_task(count: int) -> dict[str, float]:
    from bench.project.celery_apps import plain_app

    plain_app.send_task("bench.noop", kwargs={"seq": -1})  # connect and declare first
    started = time.perf_counter()
    for seq in range(count):
        plain_app.send_task("bench.noop", kwargs={"seq": seq, "payload": "x" * 16})
    return _rate(count, time.perf_counter() - started)


def _claimed_rows(row: dict[str, Any], count: int) -> list[Any]:
    from outbox_notify.relay.store import ClaimedRow

    now = dt.datetime.now(dt.UTC)
    rows = []
    for index in range(count):
        task_id = str(uuid.uuid4())
        rows.append(
            ClaimedRow(
                id=index,
                task_id=task_id,
                task_name=row["task_name"],
                args=row["args"],
                kwargs=row["kwargs"],
                options=row["options"].replace(row["task_id"], task_id),
                context=row["context"],
                retries=0,
                schema_version=row["schema_version"],
                created_at=now,
            )
        )
    return rows


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _timed(step: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = step()
    return result, time.perf_counter() - started


def _publishers() -> dict[str, Any]:
    """KombuPublisher alone, and the publisher the relay really uses (as runner builds it).

    Only the second is certain to exist in every version of the relay: KombuPublisher is
    measured when it is there and still built from the app and a send timeout.
    """
    from bench.project.celery_apps import ours_app
    from outbox_notify.relay.config import RelayConfig
    from outbox_notify.relay.runner import build_relay

    found: dict[str, Any] = {}
    with contextlib.suppress(ImportError, TypeError):
        from outbox_notify.relay.publisher import KombuPublisher

        found["KombuPublisher"] = KombuPublisher(ours_app, send_timeout=10.0)
    relay_publisher = build_relay(RelayConfig(), listen=False, wake_fd=None).publisher
    if type(relay_publisher).__name__ not in found:
        found[type(relay_publisher).__name__] = relay_publisher
    return found


def _our_publish_path(row: dict[str, Any], count: int, publisher: Any) -> dict[str, Any]:
    from outbox_notify.relay import messages
    from outbox_notify.relay.publisher import Result

    publisher.check()
    batches = _batches(_claimed_rows(row, count), PUBLISH_BATCH)
    now = dt.datetime.now(dt.UTC)
    prepared, prepare_s = _timed(lambda: [[messages.prepare(r, now) for r in b] for b in batches])
    attempts, publish_s = _timed(lambda: [publisher.publish(b, lambda: False) for b in prepared])
    publisher.close()
    failed = sum(a.result is not Result.PUBLISHED for batch in attempts for a in batch)
    return {
        "prepare_and_publish": _rate(count, prepare_s + publish_s),
        "prepare_only": _rate(count, prepare_s),
        "publish_only": _rate(count, publish_s),
        "not_published": failed,
    }


SETTLE_TIMEOUT = 30.0  # seconds for messages sent without confirms to reach the queue


def _wait_for_depth(reader: Any, queue: str, count: int) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while reader.depth(queue) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def ceiling(args: argparse.Namespace) -> None:
    """How fast this machine gets Celery messages into the broker, without any database."""
    _django()
    from django.conf import settings

    from bench.brokers import depth_reader

    reader = depth_reader(settings.BROKER_URL)
    reader.purge(settings.OURS_QUEUE)
    plain = _plain_send_task(args.count)
    # Without confirms the last messages may still be on their way: let them land before the
    # purge, or they would be counted as our path's.
    _wait_for_depth(reader, settings.OURS_QUEUE, args.count + 1)
    reader.purge(settings.OURS_QUEUE)
    row = json.loads(Path(args.template).read_text())
    paths = {}
    for name, publisher in _publishers().items():
        paths[name] = _our_publish_path(row, args.count, publisher)
        paths[name]["in_broker"] = reader.depth(settings.OURS_QUEUE)
        reader.purge(settings.OURS_QUEUE)
    reader.close()
    print(json.dumps({"plain_send_task": plain, "ours": paths}))


# --- command line -----------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.workers")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("template")
    sub.add_argument("--side", choices=("ours", "peer"), required=True)
    sub = commands.add_parser("produce")
    for flag in ("--dsn", "--sql", "--out"):
        sub.add_argument(flag, required=True)
    sub.add_argument("--rate", type=float, required=True)
    sub.add_argument("--seconds", type=float, required=True)
    sub.add_argument("--threads", type=int, default=8)
    sub.add_argument("--per-tx", type=int, default=1, help="rows per transaction")
    sub = commands.add_parser("consume")
    for flag in ("--url", "--queue", "--out"):
        sub.add_argument(flag, required=True)
    sub.add_argument("--ids-only", action="store_true", help="Redis: parse each body at once")
    sub = commands.add_parser("enqueue")
    sub.add_argument("--side", choices=("ours", "peer"), required=True)
    sub.add_argument("--per-tx", required=True, help="comma-separated batch sizes")
    sub.add_argument("--seconds", type=float, required=True)
    sub = commands.add_parser("ceiling")
    sub.add_argument("--count", type=int, required=True)
    sub.add_argument("--template", required=True)
    return parser.parse_args(argv)


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "template": template,
    "produce": produce,
    "consume": consume,
    "enqueue": enqueue,
    "ceiling": ceiling,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    COMMANDS[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
