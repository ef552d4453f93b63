"""What the Prometheus metrics cost the relay per message: metrics off versus on, alternated.

Run: .venv/bin/python -m bench.metrics_cost [--rows 20000] [--rounds 3] [--json PATH]

Starts a private PostgreSQL, applies sql/install.sql, and for each round runs two drains, one
relay without metrics and one with `--metrics-port 0` (the order alternating round by round):
a relay is started and settles, --rows messages are committed in one transaction, and the
drain ends when the Redis list holds them all. It reports, per mode, the relay's CPU seconds
per message (utime + stime from /proc, start-up excluded) and messages per second, their
medians, and the ratio on/off. With metrics on, /metrics is scraped while draining (as
Prometheus would, a few times) and once after, and must count every message. Redis:
OUTBOX_BENCH_REDIS_URL, default redis://127.0.0.1:6379/12.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.procs import cpu_seconds
from devtools import pgserver
from outbox_notify import sql

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
QUEUE = "outbox-bench-metrics"
SETTLE = 1.5  # seconds between a relay's outbox.relay_started and the commit of the backlog
SCRAPE_EVERY = 0.5  # seconds between scrapes while draining (Prometheus's default is 15 s)
DEADLINE = 300.0  # seconds one drain may take
LOGS = Path(tempfile.mkdtemp(prefix="outbox-bench-metrics-"))  # the relays' output
PUBLISHED = re.compile(rb'^outbox_notify_published_total\{task_name="bench.noop"\} (\S+)$', re.M)


def _options(task_id: str) -> str:
    headers = {"lang": "py", "task": "bench.noop", "id": task_id, "retries": 0, "root_id": task_id}
    return json.dumps(
        {
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
    )


def _commit_backlog(url: str, rows: int, round_no: int) -> None:
    """--rows messages in one transaction, written with COPY."""
    columns = "task_id, task_name, args, kwargs, options, schema_version"
    with (
        psycopg.connect(url) as conn,
        conn.cursor() as cursor,
        cursor.copy(f"COPY outbox_notify_message_v1 ({columns}) FROM STDIN") as copy,
    ):
        for n in range(rows):
            task_id = f"m{round_no}-{n}"
            copy.write_row((task_id, "bench.noop", "[]", "{}", _options(task_id), 1))


def _relay(url: str, log: Path, metrics: bool) -> subprocess.Popen[bytes]:
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", OUTBOX_TEST_DATABASE_URL=url)
    env.update(
        OUTBOX_TEST_DB_NAME="postgres", OUTBOX_TEST_BROKER_URL=REDIS_URL, PYTHONPATH=str(ROOT)
    )
    argv = [sys.executable, "-m", "django", "outbox_listen", "--sweep-interval", "5"]
    if metrics:
        argv += ["--metrics-port", "0"]
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _started(log: Path) -> int | None:
    """Wait for the relay's start (so its start-up CPU is not counted); its metrics port."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "outbox.relay_started" in text:
            found = re.search(r"outbox\.metrics_serving.*?port\W+(\d+)", text)
            return int(found.group(1)) if found else None
        time.sleep(0.05)
    raise SystemExit(f"the relay did not start:\n{log.read_text(errors='replace')}")


def _scrape(port: int) -> float:
    """outbox_notify_published_total of bench.noop, from the relay's /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        found = PUBLISHED.search(response.read())
    return float(found.group(1)) if found else 0.0


def _await_count(port: int, rows: int) -> None:
    """Wait until /metrics counts every publish: the counter moves when a batch commits,
    a moment after its messages reached the broker."""
    deadline = time.monotonic() + 30
    while (counted := _scrape(port)) < rows:
        if time.monotonic() > deadline:
            raise SystemExit(f"/metrics counted {counted} of {rows} publishes")
        time.sleep(0.05)


def one_drain(
    url: str, client: redis.Redis, rows: int, round_no: int, metrics: bool
) -> dict[str, Any]:
    """One relay, one backlog: the relay's CPU per message and the drain's rate."""
    log = LOGS / f"relay-{round_no}-{'on' if metrics else 'off'}.log"
    client.delete(QUEUE)
    relay = _relay(url, log, metrics)
    try:
        port = _started(log)
        if metrics and port is None:
            raise SystemExit(f"the relay serves no metrics:\n{log.read_text(errors='replace')}")
        time.sleep(SETTLE)
        cpu_before = cpu_seconds(relay.pid)
        _commit_backlog(url, rows, round_no)
        started = time.monotonic()
        next_scrape = started + SCRAPE_EVERY
        while client.llen(QUEUE) < rows:
            if time.monotonic() > started + DEADLINE:
                raise SystemExit(f"drain did not finish in {DEADLINE}s: {client.llen(QUEUE)}")
            if port is not None and time.monotonic() >= next_scrape:
                _scrape(port)
                next_scrape += SCRAPE_EVERY
            time.sleep(0.005)
        seconds = time.monotonic() - started
        cpu = cpu_seconds(relay.pid) - cpu_before
        if port is not None:
            _await_count(port, rows)
    finally:
        relay.terminate()
        relay.wait(timeout=30)
        client.delete(QUEUE)
    return {
        "metrics": metrics,
        "seconds": seconds,
        "cpu_us_per_msg": cpu / rows * 1e6,
        "msg_per_s": rows / seconds,
    }


def summary(drains: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per mode, and on/off ratios."""
    out: dict[str, Any] = {}
    for mode, on in (("off", False), ("on", True)):
        mine = [d for d in drains if d["metrics"] is on]
        out[mode] = {
            "cpu_us_per_msg": statistics.median(d["cpu_us_per_msg"] for d in mine),
            "msg_per_s": statistics.median(d["msg_per_s"] for d in mine),
        }
    out["cpu_ratio"] = out["on"]["cpu_us_per_msg"] / out["off"]["cpu_us_per_msg"]
    out["rate_ratio"] = out["on"]["msg_per_s"] / out["off"]["msg_per_s"]
    return out


def main() -> None:
    """Alternate drains with metrics off and on; print each and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    client = redis.Redis.from_url(REDIS_URL)
    drains: list[dict[str, Any]] = []
    with pgserver.running() as server:
        url = server.url()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.read("install.sql"))
        for round_no in range(args.rounds):
            order = (False, True) if round_no % 2 == 0 else (True, False)
            for metrics in order:
                d = one_drain(url, client, args.rows, round_no, metrics)
                drains.append(d)
                print(
                    f"round {round_no} metrics {'on ' if metrics else 'off'}: "
                    f"{d['cpu_us_per_msg']:.1f} us CPU/msg, {d['msg_per_s']:.0f} msg/s",
                    flush=True,
                )
    result = summary(drains)
    print(
        f"median over {args.rounds} rounds of {args.rows} messages: "
        f"off {result['off']['cpu_us_per_msg']:.1f} us/msg {result['off']['msg_per_s']:.0f} msg/s; "
        f"on {result['on']['cpu_us_per_msg']:.1f} us/msg {result['on']['msg_per_s']:.0f} msg/s; "
        f"CPU on/off {result['cpu_ratio']:.3f}, rate on/off {result['rate_ratio']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"drains": drains, **result}, indent=2))


if __name__ == "__main__":
    main()
