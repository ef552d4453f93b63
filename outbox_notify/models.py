"""Django models over the tables that `sql/install.sql` creates.

The fields a user does not know (schema version, timestamps, counters, context) carry as
Python defaults what the database defaults, so `objects.create()` with the task's own fields
works. Python defaults, not `db_default`: Django 4.2 has no `db_default`, and the SQL files
stay the single source of the database's own defaults.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from outbox_notify.fields import JSONTextField

# What a row gets by default: the layout every relay reads.
from outbox_notify.serialization import DEFAULT_VERSION as SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "DeadLetter", "InboxRecord", "OutboxMessage"]


class OutboxMessage(models.Model):
    """A task waiting to be published to the broker by a relay."""

    id = models.BigAutoField(primary_key=True)
    task_id = models.TextField(db_index=True)
    task_name = models.TextField()
    args = JSONTextField()
    kwargs = JSONTextField()
    options = JSONTextField()
    context = JSONTextField(default=dict)
    schema_version = models.SmallIntegerField(default=SCHEMA_VERSION)
    retries = models.IntegerField(default=0)
    retry_after = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL means never failed
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "outbox_notify_message_v1"
        verbose_name = "outbox message"
        ordering = ("id",)

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"


class OutboxDashboard(OutboxMessage):
    """The admin index's "Outbox dashboard" entry: a proxy (no table) whose admin page leads
    to the dashboard; it has no permissions of its own (viewing outbox messages is the one)."""

    class Meta:
        proxy = True
        verbose_name = verbose_name_plural = "outbox dashboard"
        default_permissions = ()


class DeadLetter(models.Model):
    """A task that exhausted its retries or could not be decoded; kept for operators."""

    id = models.BigAutoField(primary_key=True)
    task_id = models.TextField(db_index=True)
    task_name = models.TextField(db_index=True)
    args = JSONTextField()
    kwargs = JSONTextField()
    options = JSONTextField()
    context = JSONTextField(default=dict)
    schema_version = models.SmallIntegerField(default=SCHEMA_VERSION)
    retries = models.IntegerField(default=0)
    failure_reason = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)
    dead_at = models.DateTimeField(db_index=True, default=timezone.now)

    class Meta:
        db_table = "outbox_notify_dead_letter_v1"
        verbose_name = "dead letter"
        ordering = ("-dead_at", "-id")

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"


class InboxRecord(models.Model):
    """A key whose OnceTask body committed: later deliveries of it are skipped (read-only)."""

    id = models.BigAutoField(primary_key=True)
    scope = models.TextField()
    key = models.TextField()
    task_id = models.TextField()
    task_name = models.TextField()
    created_at = models.DateTimeField(db_index=True, default=timezone.now)

    class Meta:
        db_table = "outbox_notify_inbox_v1"
        verbose_name = "inbox record"
        ordering = ("-id",)
        constraints = (
            models.UniqueConstraint(
                fields=("scope", "key"), name="outbox_notify_inbox_v1_scope_key_key"
            ),
        )

    def __str__(self) -> str:
        return f"{self.scope}:{self.key}"
