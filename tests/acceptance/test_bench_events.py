"""`python -m bench.events` runs end to end on both brokers and prints its figures.

Only that it ran (every event and task arrived, or it would exit non-zero) and printed a
figure per broker is checked, never a timing: figures belong in the benchmark's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # seconds: generous; a run this small takes well under a minute


@pytest.mark.redis
@pytest.mark.rabbitmq
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_tiny_run_prints_events_per_second_for_both_brokers(
    redis_url: str, amqp_url: str
) -> None:
    """Both brokers report events/s and tasks/s after every message of each round arrived."""
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["OUTBOX_BENCH_REDIS_URL"] = redis_url
    env["OUTBOX_BENCH_AMQP_URL"] = amqp_url
    env["OUTBOX_BENCH_EVENTS_NAME"] = f"outbox-test-bench-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-m", "bench.events", "--events", "300", "--rounds", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for broker in ("rabbitmq", "redis"):
        line = re.search(rf"^{broker}: ([\d,]+) events/s .*tasks: ([\d,]+)/s", done.stdout, re.M)
        assert line is not None, done.stdout
        assert int(line.group(1).replace(",", "")) > 0
