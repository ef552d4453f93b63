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

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # seconds: generous; a run this small takes well under a minute


@pytest.mark.redis
@pytest.mark.worker
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("reuse", ["0", "1000"], ids=["reconnect", "reuse"])
def test_a_tiny_run_reports_every_kind_and_overhead(
    tmp_path: Path, redis_url: str, pg_server_url: str, reuse: str
) -> None:
    """Every kind ran its blocks, every OnceTask execution left its key, overheads printed."""
    out = tmp_path / "once.json"
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["OUTBOX_BENCH_REDIS_URL"] = redis_url.rsplit("/", 1)[0] + "/11"
    argv = ["--tasks", "20", "--rounds", "2", "--calls", "20", "--db-reuse-max", reuse]
    argv += ["--dsn", pg_server_url]
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
    assert set(report["kinds"]) == {
        "plain_noop",
        "once_noop",
        "plain_row",
        "plain_row_atomic",
        "once_row",
    }
    assert set(report["overhead"]) == {"noop", "one row", "one row, plain in atomic()"}
    # 2 rounds x 2 OnceTask kinds x (20 timed + 50 warm-up tasks) keys; 3 row kinds' effects.
    assert report["verified"] == {"inbox_keys": 280, "effects": 420}
    assert "OnceTask overhead (one row)" in done.stdout
    assert set(report["execution_path"]["overhead_us"]) == set(report["overhead"])
    assert report["execution_path"]["reconnect"] is (reuse == "0")
