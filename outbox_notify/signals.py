"""Signals about outbox rows, each sent with send_robust after the state it reports commits."""

from __future__ import annotations

from django.dispatch import Signal

# task_id, task_name: the row is committed in the outbox.
outbox_message_created = Signal()
# task_id, task_name: the broker accepted the message and the row is gone.
outbox_message_sent = Signal()
# task_id, task_name, retries: a publish failed and the row was rescheduled.
outbox_message_failed = Signal()
# task_ids, task_names: rows moved to the dead-letter table.
outbox_message_dead_lettered = Signal()
