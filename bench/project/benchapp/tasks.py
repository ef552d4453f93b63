"""The trivial task every scenario enqueues (nothing consumes it: the benchmark pops the list)."""

from __future__ import annotations

from typing import Any

from bench.project.celery_apps import ours_app, peer_app

TASK_NAME = "bench.noop"


def _noop(**kwargs: Any) -> None:
    """Does nothing: the benchmark measures the way to the broker, not the work."""


ours_noop = ours_app.task(name=TASK_NAME)(_noop)
peer_noop = peer_app.task(name=TASK_NAME)(_noop) if peer_app is not None else None
