"""The results table (stdout) and the JSON file (--json PATH)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (
    ("scenario", "scenario"),
    ("broker", "broker"),
    ("committed", "committed"),
    ("executed", "executed"),
    ("executions", "executions"),
    ("effects applied", "effects_applied"),
    ("lost", "lost"),
    ("dead-lettered", "dead_lettered"),
    ("retries spent", "retries_spent"),
    ("lost after broker", "lost_after_broker"),
    ("dups", "duplicates"),
    ("dup rate", "duplicate_rate"),
    ("rolled back (ran)", "rolled_back"),
    ("max lat. in fault s", "max_latency_during_fault_s"),
    ("oldest row in fault s", "outbox_max_age_during_fault_s"),
    ("recovery s", "recovery_s"),
    ("p50 s", "latency_p50_s"),
    ("verdict", "verdict"),
)


def _cell(result: dict[str, Any], key: str) -> str:
    value = result.get(key)
    if key == "broker":
        return {"redis": "Redis", "rabbitmq": "RabbitMQ"}.get(str(value or "redis"), str(value))
    if key == "rolled_back":
        return f"{result['rolled_back']} ({result['rolled_back_executed']})"
    if key == "duplicate_rate":
        return f"{100 * float(value or 0):.2f} %"
    if key == "verdict":
        return "ok" if not result["violations"] else "FAIL"
    if value is None:
        return "-"
    return str(value)


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per scenario."""
    header = "| " + " | ".join(title for title, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    rows = [
        "| " + " | ".join(_cell(result, key) for _, key in COLUMNS) + " |" for result in results
    ]
    return "\n".join([header, rule, *rows])


def details(results: list[dict[str, Any]]) -> str:
    """Per scenario: what was done, poison verdicts, relay log events, and any violation."""
    lines: list[str] = []
    for result in results:
        lines.append(f"- {result['scenario']}: {result['what']}")
        lines.append(
            f"  lost after the broker had it={result['lost_after_broker']} (of them taken by a "
            f"worker={result['lost_after_broker_taken_by_worker']}, still unacknowledged in the "
            f"broker={result.get('lost_after_broker_still_unacked', 0)}); "
            f"duplicates republished={result['duplicates_republished']} "
            f"redelivered={result['duplicates_redelivered']} "
            f"untraced={result.get('duplicates_untraced', 0)}; publishes received but not stored="
            f"{result.get('broker_not_stored', 0)}; broker queue max={result.get('broker_queue_max')}"
            f"; aborted by errors="
            f"{result['aborted_by_errors']}; ambiguous commits (committed/not)="
            f"{result['ambiguous_committed']}/{result['ambiguous_not']}; commits/s before/"
            f"during={result['commits_per_s_before']}/{result['commits_per_s_during']}; "
            f"drained in {result['drain_seconds']} s"
        )
        lines.append(
            f"  effects (OnceTask) applied={result['effects_applied']} "
            f"missing={result['effects_missing']} twice={result['effects_twice']} "
            f"never committed={result['effects_unexpected']}; executions={result['executions']}"
            f" (extra={result['extra_executions']}); worker kills={result.get('worker_kills', 0)}"
        )
        lines.append(f"  relay log: {result['relay_log_events']}")
        for exit_ in result.get("worker_exits", []):
            lines.append(f"  worker restarted (code {exit_['returncode']}): {exit_['error']}")
        for verdict in result.get("poison", []):
            mark = "ok" if verdict["ok"] else "WRONG"
            lines.append(f"  poison {verdict['kind']}: {verdict['observed']} [{mark}]")
        if result.get("wake_lock_holder_max_idle_s", 0) > 5.0:
            lines.append(
                "  NOTE: a session held the wake lock while idle for "
                f"{result['wake_lock_holder_max_idle_s']} s (> --stale-timeout)"
            )
        if result.get("notify_queue_usage_max") is not None:
            lines.append(f"  notify queue usage max: {result['notify_queue_usage_max']}")
        if result["violations"]:  # what the faults did, to read the failure by
            lines.extend(f"  event at {at} s: {text}" for at, text in result.get("events", []))
        lines.extend(f"  VIOLATION: {text}" for text in result["violations"])
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
