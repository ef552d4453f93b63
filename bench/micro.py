"""Enqueue cost and the publishing ceiling: the two ends of the pipe, measured alone.

enqueue: `task.delay()` inside `transaction.atomic()`, 1 and 100 messages per transaction, in
a fresh process per library (no relay running); rows per second.
ceiling: how fast this machine gets Celery messages into a broker at all, with no database: a
plain `celery.Celery.send_task` loop, and our relay's own path (messages.prepare + the
publisher's publish, in batches of 100) fed synthetic claimed rows; once per broker.
"""

from __future__ import annotations

import json
from typing import Any

from bench import db
from bench.procs import BenchError
from bench.sides import World

PER_TRANSACTION = (1, 100)
ENQUEUE_SECONDS = 3.0
QUICK_ENQUEUE_SECONDS = 1.0
CEILING_MESSAGES = 5_000
QUICK_CEILING_MESSAGES = 2_000
WORKER_TIMEOUT = 300.0  # seconds


def _worker_json(world: World, name: str, args: list[str]) -> Any:
    worker = world.worker(name, args)
    try:
        status = worker.popen.wait(WORKER_TIMEOUT)
    finally:
        world.procs.stop(worker)
    if status != 0:
        raise BenchError(f"{name} failed ({status}):\n{worker.tail()}")
    lines = [line for line in worker.output().splitlines() if line.startswith(("{", "["))]
    if not lines:
        raise BenchError(f"{name} printed no result:\n{worker.tail()}")
    return json.loads(lines[-1])


def enqueue(world: World) -> dict[str, Any]:
    """Rows per second for each batch size, one process per library, libraries in turn."""
    seconds = QUICK_ENQUEUE_SECONDS if world.quick else ENQUEUE_SECONDS
    sizes = ",".join(str(n) for n in PER_TRANSACTION)
    rows = []
    for side in world.sides:
        db.reset(world, side)
        args = ["enqueue", "--side", side.key, "--per-tx", sizes, "--seconds", str(seconds)]
        rows += [{"side": side.key, **r} for r in _worker_json(world, f"enqueue-{side.key}", args)]
        db.reset(world, side)
    return {"seconds": seconds, "rows": rows}


def ceiling(world: World) -> dict[str, Any]:
    """Plain send_task and our publish path, straight to the broker."""
    ours = next(s for s in world.sides if s.key == "ours")
    count = QUICK_CEILING_MESSAGES if world.quick else CEILING_MESSAGES
    template = world.work_dir / "template-ours.json"
    template.write_text(json.dumps(ours.template))
    result = _worker_json(
        world,
        f"ceiling-{world.broker.key}",
        ["ceiling", "--count", str(count), "--template", str(template)],
    )
    for name, path in result["ours"].items():
        if path["not_published"] or path["in_broker"] != count:
            raise BenchError(f"our publish path {name} lost messages: {path}")
    return {"broker": world.broker.key, **result}
