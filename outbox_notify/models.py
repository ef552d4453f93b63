"""Django models over the outbox tables that `sql/install.sql` creates."""

from __future__ import annotations

from django.db import models

from outbox_notify.fields import JSONTextField
from outbox_notify.serialization import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "DeadLetter", "OutboxMessage"]


class OutboxMessage(models.Model):
    """A task waiting to be published to the broker by a relay."""

    id = models.BigAutoField(primary_key=True)
    task_id = models.TextField(db_index=True)
    task_name = models.TextField()
    args = JSONTextField()
    kwargs = JSONTextField()
    options = JSONTextField()
    context = JSONTextField(default=dict)
    schema_version = models.SmallIntegerField()
    retries = models.IntegerField(default=0)
    retry_after = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL means never failed
    created_at = models.DateTimeField()

    class Meta:
        db_table = "outbox_notify_message_v1"
        verbose_name = "outbox message"
        ordering = ("id",)

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"


class DeadLetter(models.Model):
    """A task that exhausted its retries or could not be decoded; kept for operators."""

    id = models.BigAutoField(primary_key=True)
    task_id = models.TextField(db_index=True)
    task_name = models.TextField(db_index=True)
    args = JSONTextField()
    kwargs = JSONTextField()
    options = JSONTextField()
    context = JSONTextField(default=dict)
    schema_version = models.SmallIntegerField()
    retries = models.IntegerField()
    failure_reason = models.TextField()
    created_at = models.DateTimeField()
    dead_at = models.DateTimeField(db_index=True)

    class Meta:
        db_table = "outbox_notify_dead_letter_v1"
        verbose_name = "dead letter"
        ordering = ("-dead_at", "-id")

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"
