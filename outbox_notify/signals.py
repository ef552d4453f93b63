"""Signals about outbox rows and OnceTask deliveries, each sent with send_robust.

Each is sent once the state it reports is final: committed, or (for a skipped duplicate) the
delivery's empty transaction ended. Every signal here is sent with sender="outbox_notify" (a
string, the same for all seven), so `signal.connect(receiver, sender="outbox_notify")` receives
them; docs/reference.md#signals lists their arguments and when each is sent.
"""

from __future__ import annotations

from django.dispatch import Signal

# The sender of every signal below. Ask has_listeners(sender=SENDER): without a sender, Django
# counts only receivers connected without one, and would skip those connected with this one.
SENDER = "outbox_notify"

# task_id, task_name: the row is committed in the outbox.
outbox_message_created = Signal()
# task_id, task_name: the broker accepted the message and the row is gone.
outbox_message_sent = Signal()
# task_id, task_name, retries: a publish failed and the row was rescheduled.
outbox_message_failed = Signal()
# task_ids, task_names: rows moved to the dead-letter table.
outbox_message_dead_lettered = Signal()
# task_id, task_name, scope, key, first_task_id: a OnceTask delivery found its key committed
# and skipped its body (sent in the worker, after the skip).
outbox_duplicate_skipped = Signal()
# event_id, event_source, event_type, consumer, scope: an events Consumer found the event
# (its source and id) committed in its scope and skipped the handler (sent in the consumer,
# after the skip).
outbox_event_duplicate_skipped = Signal()
# event_id, event_type (None when the body could not be read), consumer, reason: an events
# Consumer published a message to its dead-letter exchange (sent before the message is acked).
outbox_event_dead_lettered = Signal()
