"""The execution path alone: Celery's tracer on each kind, call by call, in one process.

Run by bench.once (`python -m bench.onceproject.trace CALLS RECONNECT`) with the worker's
environment. The tracer is the one a worker runs for a delivery (not eager, no result
stored); the kinds are interleaved call by call in a rotating order, so each OnceTask call is
paired with plain calls made microseconds apart, which keeps a busy machine's drift out of the
difference. With RECONNECT=1 the connection is closed before every call, as Celery's Django
fixup does by default. Prints one JSON object: per kind, the median µs per call; per pair, the
median of the paired differences.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from typing import Any

import django

PAIRS = (
    ("noop", "plain_noop", "once_noop"),
    ("one row", "plain_row", "once_row"),
    ("one row, plain in atomic()", "plain_row_atomic", "once_row"),
)
KINDS = ("plain_noop", "once_noop", "plain_row", "plain_row_atomic", "once_row")
WARMUP = 200  # calls of each kind before timing


def _tracers() -> dict[str, Any]:
    from celery.app.trace import build_tracer

    from bench.onceproject import app as tasks

    return {
        kind: build_tracer(task.name, task, app=tasks.app, eager=False, propagate=True)
        for kind in KINDS
        for task in [getattr(tasks, kind)]
    }


def _call(tracer: Any, seq: int, reconnect: bool) -> int:
    from django.db import connection

    if reconnect:
        connection.close()
    task_id = str(uuid.uuid4())
    start = time.perf_counter_ns()
    tracer(task_id, (seq,), {}, {"id": task_id, "ignore_result": True, "delivery_info": {}})
    return time.perf_counter_ns() - start


def measure(calls: int, reconnect: bool) -> dict[str, Any]:
    """Median µs per call per kind, and the paired OnceTask - plain differences."""
    tracers = _tracers()
    for n in range(WARMUP):
        for tracer in tracers.values():
            _call(tracer, n, reconnect)
    samples: dict[str, list[int]] = {kind: [] for kind in KINDS}
    for n in range(calls):
        shift = n % len(KINDS)
        for kind in KINDS[shift:] + KINDS[:shift]:
            samples[kind].append(_call(tracers[kind], n, reconnect))
    per_kind = {kind: statistics.median(ns) / 1000 for kind, ns in samples.items()}
    paired = {
        label: statistics.median(o - p for p, o in zip(samples[plain], samples[once], strict=True))
        / 1000
        for label, plain, once in PAIRS
    }
    return {"calls": calls, "reconnect": reconnect, "us_per_call": per_kind, "overhead_us": paired}


if __name__ == "__main__":
    django.setup()
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2] == "1")))
