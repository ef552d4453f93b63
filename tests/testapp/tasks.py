"""Helpers the real Celery worker runs in acceptance tests."""

from __future__ import annotations

import json
import os
from typing import Any

from celery import current_task


def record_execution(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Append what the worker saw for this task to the file named by OUTBOX_TEST_RECORD_FILE."""
    path = os.environ["OUTBOX_TEST_RECORD_FILE"]
    request = current_task.request
    entry = {
        "id": request.id,
        "args": list(args),
        "kwargs": kwargs,
        "eta": str(request.eta) if request.eta else None,
        "expires": str(request.expires) if request.expires else None,
        "headers": {k: v for k, v in (request.headers or {}).items() if isinstance(k, str)},
        "delivery_info": request.delivery_info,
        "parent_id": request.parent_id,
        "root_id": request.root_id,
        "group": request.group,
        "timelimit": request.timelimit,
        "ignore_result": request.ignore_result,
        "shadow": getattr(request, "shadow", None),
        "x-tenant": getattr(request, "x-tenant", None) or request.get("x-tenant"),
        "retries": request.retries,
    }
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, default=str) + "\n")
