"""The task queues of a chaos run (no Django here: chaos.run reads them before set-up)."""

from __future__ import annotations

DEFAULT_QUEUE = "chaos"
# RabbitMQ only (scenario rabbit_queue_limit): a queue with a length limit that refuses
# publishes once full (`x-overflow: reject-publish`, a nack to a publisher in confirm mode).
CAPPED_QUEUE = "chaos-capped"
CAPPED_LENGTH = 100  # ready messages
