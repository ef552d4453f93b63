"""Declares the shop consumer's queue from the demo process, before any order is placed.

The relay forwards each OrderPlaced to a topic exchange; a queue bound after an event went
out would never see it. Declaring here, with the consumer's own declaration, closes that gap
whatever the consumer process's start-up time.
"""

from __future__ import annotations

import kombu


def declare_queue() -> str:
    """Declare the exchange, queue and bindings of example.shop.consumers.consumer."""
    from example.project.celery import app
    from example.shop.consumers import consumer
    from outbox_notify.events.delivery import declare

    with kombu.Connection(
        app.conf.broker_url, transport_options=app.conf.broker_transport_options
    ) as conn:
        queue = declare(consumer, conn.default_channel)
    return str(queue.name)
