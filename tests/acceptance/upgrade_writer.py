"""An application process for tests/acceptance/test_upgrade.py: commits tasks, logs their ids.

The test runs it with the interpreter and the `tests` package of either release (the previous
one's virtualenv, or this checkout's), as `python -c SOURCE MODE LOG [STOP_FILE]`, so it uses
only what both releases have: Django, `tests.celery_app.add`, `apply_async` inside
`transaction.atomic()`, and the OUTBOX_NOTIFY_HOLD_ETA_AFTER setting.

- MODE `loop`: one transaction after another until STOP_FILE exists. Each has a ready task; every
  third a task held until its ETA; every 25th a task for the failing queue (which the test
  breaks and mends: few, so that retrying them leaves the relays time for the rest); every
  tenth raises inside atomic() and rolls back.
- MODE `once`: one transaction with three tasks of each kind, committed.

Each task is a JSON line of LOG once its transaction has ended: id, kind (ready, held,
failing, rolled_back), queue, writer, began (the Unix time its transaction began).

Environment, besides the tests' settings: UPGRADE_WRITER (this writer's name), UPGRADE_QUEUE,
UPGRADE_FAILING_QUEUE, UPGRADE_HELD_FOR (countdown of held tasks, seconds).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HOLD_ETA_AFTER = 1.0  # seconds: a countdown longer than this holds the row in the outbox
PAUSE = 0.1  # seconds between two transactions of the loop


class RolledBack(Exception):
    """Raised inside atomic() to roll a transaction back."""


def kinds(number: int) -> list[str]:
    """The tasks of the loop's transaction `number`."""
    chosen = ["ready"]
    if number % 3 == 0:
        chosen.append("held")
    if number % 25 == 5:
        chosen.append("failing")
    return chosen


def enqueue(kind: str) -> tuple[str, str]:
    """Write one task of `kind` on the current transaction: (task id, queue)."""
    from tests.celery_app import add

    queue = os.environ["UPGRADE_FAILING_QUEUE" if kind == "failing" else "UPGRADE_QUEUE"]
    options: dict[str, Any] = {"queue": queue}
    if kind == "held":
        options["countdown"] = float(os.environ["UPGRADE_HELD_FOR"])
    return add.apply_async((1, 2), **options).id, queue


def commit(chosen: list[str], *, roll_back: bool) -> list[dict[str, Any]]:
    """One transaction writing `chosen`; the log lines of its tasks."""
    from django.db import transaction

    began = time.time()
    written: list[tuple[str, str, str]] = []
    try:
        with transaction.atomic():
            written = [(kind, *enqueue(kind)) for kind in chosen]
            if roll_back:
                raise RolledBack
    except RolledBack:
        written = [("rolled_back", task_id, queue) for _, task_id, queue in written]
    writer = os.environ["UPGRADE_WRITER"]
    return [
        {"id": task_id, "kind": kind, "queue": queue, "writer": writer, "began": began}
        for kind, task_id, queue in written
    ]


def main(mode: str, log_path: str, stop_file: str = "") -> None:
    import django

    django.setup()
    from django.conf import settings

    settings.OUTBOX_NOTIFY_HOLD_ETA_AFTER = HOLD_ETA_AFTER
    with Path(log_path).open("a", encoding="utf-8") as log:
        number = 0
        while True:
            if mode == "once":
                lines = commit(["ready", "held", "failing"] * 3, roll_back=False)
            else:
                lines = commit(kinds(number), roll_back=number % 10 == 9)
            log.writelines(json.dumps(line) + "\n" for line in lines)
            log.flush()
            number += 1
            if mode == "once" or Path(stop_file).exists():
                return
            time.sleep(PAUSE)


if __name__ == "__main__":
    main(*sys.argv[1:])
