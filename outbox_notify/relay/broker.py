"""Chooses the relay's publisher for its broker: a fast path where there is one, else kombu's."""

from __future__ import annotations

from typing import Any

from outbox_notify.relay.amqp_publisher import AmqpConfirmPublisher
from outbox_notify.relay.publisher import KombuPublisher, Publisher
from outbox_notify.relay.redis_publisher import RedisPipelinePublisher


def publisher_for(app: Any, *, send_timeout: float) -> Publisher:
    """The publisher for the Celery app's broker (no connection is made here)."""
    general = KombuPublisher(app, send_timeout=send_timeout)
    driver = general.driver
    if driver == "redis":
        return RedisPipelinePublisher(general)
    if driver == "amqp":
        return AmqpConfirmPublisher(general)
    return general
