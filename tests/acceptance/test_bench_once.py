"""`python -m bench.once` runs end to end against a real worker and reports every figure.

Only that it ran and counted every execution is checked, never a timing: figures belong in
the benchmark's report, not in a test's assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import once as bench_once

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # seconds: generous; a run this small takes well under a minute


@pytest.mark.redis
@pytest.mark.worker
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_tiny_run_reports_both_phases_every_kind_and_the_goal(
    tmp_path: Path, redis_url: str, pg_server_url: str
) -> None:
    """Both connection phases ran every kind's blocks, left every key, printed the overheads."""
    out = tmp_path / "once.json"
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["OUTBOX_BENCH_REDIS_URL"] = redis_url.rsplit("/", 1)[0] + "/11"
    argv = ["--tasks", "20", "--rounds", "2", "--calls", "20", "--dsn", pg_server_url]
    done = subprocess.run(
        [sys.executable, "-m", "bench.once", *argv, "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    phases = {phase["name"]: phase for phase in report["phases"]}
    assert list(phases) == ["new connection", "persistent"]
    for name, phase in phases.items():
        assert set(phase["kinds"]) == {
            "plain_noop",
            "once_noop",
            "plain_row",
            "plain_row_atomic",
            "once_row",
        }
        assert set(phase["overhead"]) == {"noop", "one row", "one row, plain in atomic()"}
        # 2 rounds x 2 OnceTask kinds x (20 timed + 50 warm-up tasks) keys; 3 row kinds' effects.
        assert phase["verified"] == {"inbox_keys": 280, "effects": 420}
        assert set(phase["execution_path"]["overhead_us"]) == set(phase["overhead"])
        assert phase["execution_path"]["reconnect"] is (name == "new connection")
        assert f"[{name}]" in done.stdout
    assert report["goal"]["phase"] == "persistent"
    assert report["goal"]["pair"] == "one row"
    assert report["goal_in_atomic"]["pair"] == "one row, plain in atomic()"
    assert "OnceTask against the plain task in autocommit)" in done.stdout
    assert "OnceTask against the plain task in atomic())" in done.stdout
    section = bench_once.markdown(report)
    assert "**new connection**" in section
    assert "**persistent**" in section
    assert section.count("Goal (") == 2


def test_a_report_from_before_the_phases_still_renders() -> None:
    """A stored report of a run with one phase (its figures at the top level) still renders."""
    kind = {
        "ms_per_task": 7.0,
        "tasks_per_second": 142.0,
        "worker_cpu_us_per_task": 2718.0,
        "backend_cpu_us_per_task": None,
    }
    pair = {
        "ms_per_task": 0.486,
        "ms_per_task_min": -0.625,
        "ms_per_task_max": 2.225,
        "throughput_lost_pct": 6.4,
        "worker_cpu_us_per_task": 397.0,
    }
    labels = ("noop", "one row", "one row, plain in atomic()")
    figures = {
        "kinds": dict.fromkeys(bench_once.KINDS, kind),
        "overhead": dict.fromkeys(labels, pair),
        "execution_path": {"calls": 2000, "overhead_us": dict.fromkeys(labels, 957.0)},
        "settings": {"tasks": 200, "rounds": 10, "calls": 2000, "db_reuse_max": 0},
    }
    section = bench_once.markdown(figures)
    assert "| once_row | 7.000 | 142 | 2718 | - |" in section
    assert "| one row | +0.486 (-0.625 .. +2.225) | 6.4 % | +0.957 ms | +397 µs, - |" in section
    assert "a new database connection per task" in section
