"""Quick drain figure for RabbitMQ: one real relay publishes a committed backlog into a durable
queue with publisher confirms. Not a benchmark of record (bench/ has those); a smoke figure.

    python -m devtools.amqp_drain [--backlog 30000] [--batch-size 100] [--amqp-url URL]
                                  [--database-url URL]

It creates a throwaway database on the PostgreSQL server (default: the machine's, as the tests
use it) and a throwaway queue on RabbitMQ, starts `manage.py outbox_listen`, commits the
backlog in one transaction, and times from that commit until the queue holds every message.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import amqp
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent


def _env(database_url: str, db_name: str, amqp_url: str, queue: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "OUTBOX_TEST_DATABASE_URL": database_url,
        "OUTBOX_TEST_DB_NAME": db_name,
        "OUTBOX_TEST_BROKER_URL": amqp_url,
        "OUTBOX_TEST_QUEUE": queue,
        "PYTHONPATH": str(ROOT),
    }


def _enqueue(env: dict[str, str], backlog: int) -> float:
    script = (
        "import django, sys, time; django.setup()\n"
        "from django.db import transaction\n"
        "from tests.celery_app import add\n"
        "with transaction.atomic():\n"
        f"    for n in range({backlog}): add.delay(n, n)\n"
        "print(time.time())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _count(channel: amqp.Channel, queue: str) -> int:
    return int(channel.queue_declare(queue, passive=True).message_count)


def main() -> None:
    """Run one drain and print its rate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=30_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--profile", help="write the relay's cProfile statistics to this file")
    args = parser.parse_args()
    db_name = f"amqp_drain_{uuid.uuid4().hex[:8]}"
    queue = f"amqp-drain-{uuid.uuid4().hex[:8]}"
    env = _env(args.database_url, db_name, args.amqp_url, queue)
    with psycopg.connect(args.database_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db_name)))
    parts = urlsplit(args.amqp_url)
    conn = amqp.Connection(
        f"{parts.hostname}:{parts.port or 5672}",
        userid=parts.username or "guest",
        password=parts.password or "guest",
    )
    conn.connect()
    channel = conn.channel()
    channel.queue_declare(queue, durable=True, auto_delete=False)
    relay = None
    try:
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "-v0"], env=env, cwd=ROOT, check=True
        )
        profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        relay = subprocess.Popen(
            [
                sys.executable,
                *profile,
                "-m",
                "django",
                "outbox_listen",
                "--batch-size",
                str(args.batch_size),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(3)  # the relay connects and settles
        cpu_before = _cpu_seconds(relay.pid)
        committed = _enqueue(env, args.backlog)
        while _count(channel, queue) < args.backlog:
            time.sleep(0.01)
        seconds = time.time() - committed
        cpu = _cpu_seconds(relay.pid) - cpu_before
        print(
            f"{args.backlog} messages in {seconds:.2f} s: {args.backlog / seconds:,.0f} msg/s "
            f"(batch size {args.batch_size}, durable queue, persistent, confirms); "
            f"relay CPU {cpu / args.backlog * 1e6:.0f} us/message"
        )
    finally:
        if relay is not None:
            relay.terminate()
            relay.wait(timeout=30)
        channel.queue_delete(queue)
        conn.close()
        with psycopg.connect(args.database_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db_name))
            )


if __name__ == "__main__":
    main()
