"""The task the example shop enqueues through the outbox."""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

from django.utils import timezone

from example.project.celery import app
from example.shop.models import Execution, Order


@app.task(bind=True, name="shop.fulfil_order")
def fulfil_order(self: Any, order_id: int, committed_at: float) -> None:
    """Mark the order fulfilled and record this run, even when the order does not exist.

    committed_at is the producer's wall clock (epoch seconds) just before it committed.
    """
    started = time.time()
    found = Order.objects.filter(pk=order_id).update(fulfilled_at=timezone.now())
    Execution.objects.create(
        order_id=order_id,
        task_id=str(self.request.id),
        executed_at=dt.datetime.fromtimestamp(started, tz=dt.UTC),
        order_missing=not found,
        latency_ms=(started - committed_at) * 1000.0,
        worker_pid=os.getpid(),
    )
