"""Tasks for the canvas tests, registered alike on the outbox app and on a plain Celery app.

The canvas tests run one canvas through both apps and compare what the two give back, so
each app needs the same tasks under the same names; `register(app)` makes them on one app.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PREFIX = "tests.canvas."


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tasks:
    """One app's canvas tasks."""

    app: Any
    add: Any
    identity: Any
    tsum: Any
    add_to_all: Any
    fail: Any
    echo: Any


def _add(x: Any, y: Any) -> Any:
    return x + y


def _identity(value: Any) -> Any:
    return value


def _tsum(values: list[int]) -> int:
    return sum(values)


def _add_to_all(values: list[int], n: int) -> list[int]:
    return [value + n for value in values]


def _fail(*args: Any) -> None:
    # A builtin exception: the caller's result backend rebuilds it by name.
    raise ValueError("tests.canvas.fail always fails")


def register(app: Any) -> Tasks:
    """Make the canvas tasks on `app` (once per app) and return them.

    Not shared (Celery's default adds every task to every app): each app keeps its own.
    """
    made = app.__dict__.get("_canvas_tasks")
    if made is not None:
        return made  # type: ignore[no-any-return]

    def echo(self: Any, key: str, message: str, *args: Any) -> str:
        # An errback or callback leaves its trace in the result backend's Redis.
        self.app.backend.client.rpush(key, message)
        return message

    made = Tasks(
        app=app,
        add=app.task(name=PREFIX + "add", shared=False)(_add),
        identity=app.task(name=PREFIX + "identity", shared=False)(_identity),
        tsum=app.task(name=PREFIX + "tsum", shared=False)(_tsum),
        add_to_all=app.task(name=PREFIX + "add_to_all", shared=False)(_add_to_all),
        fail=app.task(name=PREFIX + "fail", shared=False)(_fail),
        echo=app.task(name=PREFIX + "echo", bind=True, shared=False)(echo),
    )
    app.__dict__["_canvas_tasks"] = made
    return made
