"""With Sentry's Celery integration, the template path carries Sentry's headers and spans."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

SPAN_ID = re.compile(r"(sentry-trace\": \"[0-9a-f]{32})-[0-9a-f]{16}")
ENQUEUED = re.compile(r"(sentry-task-enqueued-time\": )[0-9.e+]+")


def normalised(options: str) -> str:
    """Options text without what Sentry makes new for every call (span id, enqueue time)."""
    return ENQUEUED.sub(r"\1<t>", SPAN_ID.sub(r"\1-<span>", options))


def run_script(subprocess_env: dict[str, Any]) -> dict[str, Any]:
    """The rows, builds and spans tests/sentry_templates.py reports."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.sentry_templates"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_sentry_headers_and_spans_are_the_same_through_the_template(
    subprocess_env: dict[str, Any],
) -> None:
    """Template rows equal full-path rows but for Sentry's per-call values; spans match too."""
    result = run_script(subprocess_env)
    assert "_wrap_task_run" in result["wrapper"]
    rows = {row["task_id"]: row for row in result["rows"]}
    assert len(result["rows"]) == 6
    for name in ("delay", "send_task"):
        assert result["built"].count(f"{name}-first") == 1
        assert f"{name}-same" in result["built"]  # by the full path only: one build
        assert result["built"].count(f"{name}-same") == 1
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_id.setdefault(row["task_id"], []).append(row)
    for name in ("delay", "send_task"):
        templated, full = by_id[f"{name}-same"]
        assert '"sentry-trace": "' in templated["options"]
        assert '"sentry-task-enqueued-time": ' in templated["options"]
        assert normalised(templated["options"]) == normalised(full["options"])
        assert {k: v for k, v in templated.items() if k != "options"} == {
            k: v for k, v in full.items() if k != "options"
        }
    assert '"x-mine": "kept"' in rows["delay-same"]["options"]
    # Each call records the same Sentry spans whichever path built its message.
    for ops in result["spans"]:
        per_call = len(ops) // 3
        assert per_call > 0
        assert sorted(ops) == sorted(ops[:per_call] * 3)
