"""How late is a retry published after its due time? (relay timers, not polling)

Run: .venv/bin/python -m bench.retry_lateness [--rows 200] [--spread 10]

Starts a private PostgreSQL, applies sql/install.sql, commits --rows messages whose
retry_after falls due at random moments over the next --spread seconds, runs one
`outbox_listen` with a 60 s sweep interval (so only its due-time timer can publish them on
time), pops the Redis queue as messages arrive and prints lateness = arrival - due time
(p50/p90/p99/max, in ms). Redis: OUTBOX_BENCH_REDIS_URL, default redis://127.0.0.1:6379/12.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import redis

from devtools import pgserver
from outbox_notify import sql

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
QUEUE = "outbox-bench-retry"


def _options(task_id: str) -> str:
    headers = {"lang": "py", "task": "bench.noop", "id": task_id, "retries": 0, "root_id": task_id}
    options = {
        "headers": headers,
        "properties": {"correlation_id": task_id},
        "embed": {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
        "exchange": "",
        "routing_key": QUEUE,
        "serializer": "json",
        "delivery_mode": 2,
        "declare": [],
        "relative": {},
    }
    return json.dumps(options)


def _insert(url: str, rows: int, spread: float) -> dict[str, float]:
    due: dict[str, float] = {}
    now = time.time()
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        for n in range(rows):
            task_id = f"retry-{n}"
            due[task_id] = now + 2.0 + random.uniform(0, spread)
            cursor.execute(
                "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options, "
                "schema_version, retries, retry_after) VALUES (%s, 'bench.noop', '[]', '{}', %s, 1, 1, "
                "to_timestamp(%s))",
                [task_id, _options(task_id), due[task_id]],
            )
    return due


def _relay(url: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", OUTBOX_TEST_DATABASE_URL=url)
    env.update(
        OUTBOX_TEST_DB_NAME="postgres", OUTBOX_TEST_BROKER_URL=REDIS_URL, PYTHONPATH=str(ROOT)
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "django",
            "outbox_listen",
            "--sweep-interval",
            "60",
            "--stale-timeout",
            "120",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _collect(client: redis.Redis, due: dict[str, float], timeout: float) -> list[float]:
    lateness: list[float] = []
    deadline = time.monotonic() + timeout
    while len(lateness) < len(due) and time.monotonic() < deadline:
        item = client.brpop([QUEUE], timeout=1)
        if item is None:
            continue
        arrived = time.time()
        task_id = json.loads(item[1])["headers"]["id"]
        lateness.append((arrived - due[task_id]) * 1000)
    return lateness


def main() -> None:
    """Measure and print retry lateness."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument(
        "--spread", type=float, default=10.0, help="seconds over which retries fall due"
    )
    args = parser.parse_args()
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(QUEUE)
    with pgserver.running() as server:
        url = server.url()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.read("install.sql"))
        relay = _relay(url)
        try:
            time.sleep(1.0)  # connected and asleep before the first retry falls due
            due = _insert(url, args.rows, args.spread)
            lateness = sorted(_collect(client, due, timeout=args.spread + 30))
        finally:
            relay.terminate()
            relay.wait(timeout=30)
            client.delete(QUEUE)
    if len(lateness) < args.rows:
        raise SystemExit(f"only {len(lateness)} of {args.rows} retries arrived")
    q = statistics.quantiles(lateness, n=100)
    print(
        f"retry lateness over {len(lateness)} retries (ms): p50 {q[49]:.1f}  p90 {q[89]:.1f}  "
        f"p99 {q[98]:.1f}  max {lateness[-1]:.1f}  min {lateness[0]:.1f}"
    )


if __name__ == "__main__":
    main()
