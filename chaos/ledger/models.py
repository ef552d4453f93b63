"""The chaos ledger: what writers committed, what the worker executed, what took effect."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """The business row a writer commits together with its message (the truth of a commit)."""

    task_id = models.CharField(max_length=64, unique=True)
    scenario = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "chaos_order"

    def __str__(self) -> str:
        return self.task_id


class Execution(models.Model):
    """One task id as the worker executed it: how often, and when first and last."""

    task_id = models.CharField(max_length=64, unique=True)
    scenario = models.CharField(max_length=64, db_index=True)
    deliveries = models.IntegerField()  # executions of this task id, redeliveries included
    redeliveries = models.IntegerField()  # executions of a message the broker flagged redelivered
    executed_at = models.DateTimeField()  # the first execution
    last_executed_at = models.DateTimeField()
    last_execution_id = models.CharField(max_length=32)  # makes the worker's retry idempotent

    class Meta:
        db_table = "chaos_execution"

    def __str__(self) -> str:
        return f"{self.task_id} x{self.deliveries}"


class Effect(models.Model):
    """One effect of `chaos.record`: the row its OnceTask body writes, in the inbox's transaction.

    Deliberately without a unique constraint: a second effect of one task id must be possible,
    so that the suite can see it (effects applied counts rows).
    """

    task_id = models.CharField(max_length=64, db_index=True)
    scenario = models.CharField(max_length=64, db_index=True)
    applied_at = models.DateTimeField()

    class Meta:
        db_table = "chaos_effect"

    def __str__(self) -> str:
        return self.task_id
