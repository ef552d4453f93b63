"""The shop's event consumer: records each OrderPlaced it receives, once per event.

Run by `manage.py outbox_consume example.shop.consumers.consumer`; the handler's insert
commits together with the inbox record of the event (its source and id), so a redelivered
event is skipped.
"""

from __future__ import annotations

import time

from django.conf import settings

from example.shop.events import OrderPlaced
from example.shop.models import EventReceipt, Order
from outbox_notify.events import Consumer, Envelope

consumer = Consumer(
    "outbox-notify-demo-receipts",
    exchange=settings.SHOP_EVENTS_EXCHANGE,
    routing_keys=("shop.#",),
)


@consumer.handler(OrderPlaced, with_envelope=True)
def record_order_placed(event: OrderPlaced, envelope: Envelope) -> None:
    """Write one EventReceipt; `order_missing` would show an event of a rolled-back order."""
    EventReceipt.objects.create(
        order_id=event.order_id,
        event_id=envelope.id,
        received_at_epoch=time.time(),
        order_missing=not Order.objects.filter(pk=event.order_id).exists(),
    )
