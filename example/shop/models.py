"""Orders, and one Execution row per run of the fulfilment task."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """An order; it exists only if the transaction that placed it committed."""

    customer = models.CharField(max_length=100)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    fulfilled_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"order {self.pk} for {self.customer}"


class Execution(models.Model):
    """One run of `shop.fulfil_order`, recorded by the worker.

    Not a foreign key to Order: a task enqueued in a rolled-back transaction must never run,
    and if it ever did, this row (with order_missing=True) is the evidence.
    """

    order_id = models.BigIntegerField(db_index=True)
    task_id = models.CharField(max_length=64)
    executed_at = models.DateTimeField()
    order_missing = models.BooleanField(default=False)
    # Milliseconds from the producer's clock reading just before its commit to this run.
    latency_ms = models.FloatField()
    worker_pid = models.IntegerField()

    def __str__(self) -> str:
        return f"execution of order {self.order_id} ({self.task_id})"


class EventReceipt(models.Model):
    """One OrderPlaced event handled by the shop's consumer (example/shop/consumers.py).

    The consumer's inbox makes this once per event: a duplicate delivery is skipped before
    the handler runs, so two receipts for one order would mean the guarantee failed.
    """

    order_id = models.BigIntegerField(db_index=True)
    event_id = models.CharField(max_length=64)
    received_at_epoch = models.FloatField()
    order_missing = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"event {self.event_id} for order {self.order_id}"
