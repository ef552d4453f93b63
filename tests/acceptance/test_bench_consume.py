"""`python -m bench.consume` runs end to end on both brokers and reports a figure for each.

Only that it ran, and that every event left exactly one row and one inbox key (the benchmark
exits non-zero otherwise), is checked, never a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # seconds: generous; a run this small takes a few seconds


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_tiny_run_reports_events_per_second_on_both_brokers(
    tmp_path: Path, redis_url: str, amqp_url: str, pg_server_url: str
) -> None:
    """Both brokers ran two rounds of 30 events, each round verified, figures printed."""
    out = tmp_path / "consume.json"
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["OUTBOX_BENCH_REDIS_URL"] = redis_url.rsplit("/", 1)[0] + "/11"
    env["OUTBOX_BENCH_AMQP_URL"] = amqp_url
    argv = ["--events", "30", "--rounds", "2", "--dsn", pg_server_url, "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.consume", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"rabbitmq", "redis"}
    for figures in report.values():
        assert figures["events"] == 30
        assert len(figures["rounds"]) == 2
    assert "events consumed per second" in done.stdout
