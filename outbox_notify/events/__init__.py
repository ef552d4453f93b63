"""Domain events through the outbox: published in the caller's transaction, consumed once.

The wire format (CloudEvents 1.0, structured JSON mode) is in `envelope`.
"""

from outbox_notify.events.consumer import Consumer
from outbox_notify.events.envelope import CONTENT_TYPE, Envelope, UndecodableEvent
from outbox_notify.events.publishing import EventError, publish

__all__ = ["CONTENT_TYPE", "Consumer", "Envelope", "EventError", "UndecodableEvent", "publish"]
