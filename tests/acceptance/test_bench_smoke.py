"""The benchmark harness runs end to end: every scenario of `bench.run --quick --no-peer` completes.

Only whether each scenario ran is checked, never a figure: timings belong in the benchmark's
report, not in a test's assertions. --no-peer keeps it offline and fast (no second venv, no
django-celery-outbox); the harness starts its own PostgreSQL, redis-server and RabbitMQ node
and stops them. The scenarios that touch a broker run on both Redis and RabbitMQ; the
registered benchmarks with a quick mode (bench/standalone.py: once, held) run on its Redis.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import standalone
from tests.conftest import IN_CI

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 900.0  # seconds: generous; the run itself takes about four minutes
TRIGGER_TIMEOUT = 240.0  # seconds; the trigger benchmark's tiny run takes about 20
BENCH_REDIS_URL = "redis://127.0.0.1:6379/12"  # bench/trigger.py's default


PER_BROKER = ("latency", "drain", "crash", "ceiling")


def _server_available(binary_found: bool, port: int) -> bool:
    if binary_found:
        return True
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _require_brokers() -> None:
    """Skip locally, fail under CI, when neither a private nor a shared broker is there."""
    from devtools import rabbitserver

    missing = [
        name
        for name, found in (
            ("Redis", _server_available(bool(shutil.which("redis-server")), 6379)),
            ("RabbitMQ", _server_available(rabbitserver.installed(), 5672)),
        )
        if not found
    ]
    if not missing:
        return
    message = f"no server for {', '.join(missing)} (neither installed nor on localhost)"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.mark.redis
@pytest.mark.rabbitmq
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_quick_run_completes_every_scenario(tmp_path: Path) -> None:
    """`python -m bench.run --quick --no-peer` exits 0 and reports every scenario as ok, on both brokers."""
    _require_brokers()
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_SETTINGS")}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--no-peer", "--out", str(out),
         "--work-dir", str(tmp_path / "work")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert out.exists(), f"no report written\n{done.stdout}\n{done.stderr}"
    report = json.loads(out.read_text())
    failed = {n: s["error"] for n, s in report["scenarios"].items() if s["status"] != "ok"}
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed.items())
    per_broker = {f"{name}.{broker}" for name in PER_BROKER for broker in ("redis", "rabbitmq")}
    quick_standalone = {b.key for b in standalone.REGISTRY if b.quick is not None}
    on_redis = {"snapshot", "soak", "versus"}  # the old snapshot and the soak in seconds; versus
    assert set(report["scenarios"]) >= {"writers", "idle", "enqueue", *on_redis, *per_broker}
    assert set(report["scenarios"]) >= quick_standalone  # once, held: bench/standalone.py
    assert done.returncode == 0, done.stderr
    _assert_broker_named_everywhere(report, tmp_path)


def _assert_broker_named_everywhere(report: dict[str, Any], tmp_path: Path) -> None:
    """The rendered report has a Redis and a RabbitMQ part in every per-broker section."""
    from bench import report as reporting

    docs = tmp_path / "benchmarks.md"
    reporting.write_docs(report, docs, tmp_path / "img")
    sections = {part.split("\n", 1)[0]: part for part in docs.read_text().split("\n## ")[1:]}
    titles = {title for key, title, _ in reporting.SECTIONS if key in PER_BROKER}
    assert titles <= set(sections), sorted(sections)
    for title in titles:
        assert "### Redis\n\nBroker: Redis" in sections[title], sections[title][:400]
        assert "### RabbitMQ\n\nBroker: RabbitMQ" in sections[title], sections[title][:400]


@pytest.mark.redis
@pytest.mark.timeout(TRIGGER_TIMEOUT + 60)
def test_trigger_bench_runs_with_the_real_relay(tmp_path: Path) -> None:
    """`python -m bench.trigger --relay-cmd ...` completes every configuration with a real relay.

    Tiny runs (1 s, 1 and 2 writers); only what does not depend on timing is checked: every
    configuration ran, the relay asleep all run (c) made every writer transaction notify, the
    real relay of (d) was woken by notifications (it is asleep when the writers start) and
    nothing notified without a trigger (f).
    """
    from tests.conftest import require_service

    require_service("Redis", os.environ.get("OUTBOX_BENCH_REDIS_URL", BENCH_REDIS_URL), 6379)
    out = tmp_path / "trigger.json"
    relay = f"{sys.executable} -m django outbox_listen --settings=tests.settings"
    done = subprocess.run(
        [sys.executable, "-m", "bench.trigger", "--writers", "1,2", "--rounds", "1",
         "--seconds", "1", "--relay-cmd", relay, "--json", str(out)],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("DJANGO_SETTINGS")},
        capture_output=True,
        text=True,
        timeout=TRIGGER_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads(out.read_text())
    cells = {(s["config"], s["writers"]): s for s in report["summary"]}
    assert set(cells) == {(c, w) for c in "abcdef" for w in (1, 2)}
    for writers in (1, 2):
        assert cells["c", writers]["notified_share"] == pytest.approx(1.0, abs=0.01)
        assert cells["d", writers]["notified_share"] > 0
        assert cells["f", writers]["notified_share"] == 0
    assert "(d) / (f)" in done.stdout
