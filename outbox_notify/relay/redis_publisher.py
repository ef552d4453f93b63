"""The Redis fast path: a whole batch in one pipelined round trip, envelopes built by kombu.

Celery over Redis publishes through kombu's Producer, which costs ~170 µs a message. For
messages routed the way Celery routes by default (the nameless exchange, the queue name as
routing key, JSON, no compression), this publisher asks kombu's own Redis channel to build
the very same envelope (prepare_message, then the in-place augmentation publish applies),
and sends all LPUSHes of the batch in one pipeline. Anything else goes through the
KombuPublisher it wraps, so every message is still exactly what Celery would have sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kombu.common import maybe_declare
from kombu.entity import maybe_delivery_mode
from kombu.utils.json import dumps

from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.relay import fastjson
from outbox_notify.relay.messages import JSON_CONTENT_TYPE, OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    KombuPublisher,
    Result,
    broker_refuses_writes,
    error_text,
)

# Queue arguments that make kombu's Redis transport do more than one LPUSH per message.
_SPECIAL_QUEUE_ARGS = ("expires", "message_ttl", "max_length", "max_length_bytes")


def _eligible(message: OutgoingMessage) -> bool:
    spec = message.spec
    if spec.exchange != "" or not spec.routing_key:
        return False
    if spec.serializer != "json" or spec.compression:
        return False
    return not any(q.get(arg) for q in spec.declare_json for arg in _SPECIAL_QUEUE_ARGS)


class RedisPipelinePublisher:
    """Publishes default-routed JSON messages with one Redis round trip per batch."""

    def __init__(self, fallback: KombuPublisher) -> None:
        self.fallback = fallback
        self.declared: set[str] = set()
        self.declared_on: Any = None

    def check(self) -> None:
        """Raise BrokerUnavailable unless the broker can be reached now."""
        self.fallback.check()

    def close(self) -> None:
        """Drop the broker connection."""
        self.fallback.close()

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Fast path when every message qualifies and the broker is Redis; else kombu."""
        try:
            producer = self.fallback.connect()
        except BrokerUnavailable as exc:
            return [Attempt(Result.OUTAGE, str(exc))] * len(messages)
        channel = producer.channel
        if not hasattr(channel, "_q_for_pri") or not all(map(_eligible, messages)):
            return self.fallback.publish(messages, deadline)
        return self._pipelined(producer, channel, messages, deadline)

    def _declare(self, channel: Any, message: OutgoingMessage) -> None:
        if channel is not self.declared_on:
            self.declared, self.declared_on = set(), channel
        for queue in message.spec.declare_json:
            if queue["name"] not in self.declared:
                for entity in message.spec.declare:
                    maybe_declare(entity, channel)
                    self.declared.add(entity.name)

    def _envelope(
        self, producer: Any, channel: Any, message: OutgoingMessage
    ) -> tuple[str, str | bytes]:
        spec = message.spec
        properties = dict(spec.properties)
        priority = properties.pop("priority", 0)
        properties["delivery_mode"] = maybe_delivery_mode(
            spec.delivery_mode or producer.exchange.delivery_mode
        )
        if message.expiration is not None:
            properties["expiration"] = str(int(message.expiration * 1000))
        body = message.body.encode("utf-8")
        envelope = channel.prepare_message(
            body, priority, JSON_CONTENT_TYPE, "utf-8", message.headers, properties
        )
        channel._inplace_augment_message(envelope, "", spec.routing_key)
        key = channel._q_for_pri(
            spec.routing_key, channel._get_message_priority(envelope, reverse=False)
        )
        return key, (fastjson.dumps(envelope) if message.plain else dumps(envelope))

    def _pipelined(
        self,
        producer: Any,
        channel: Any,
        messages: Sequence[OutgoingMessage],
        deadline: Callable[[], bool],
    ) -> list[Attempt]:
        # One LPUSH per queue key with all of its messages: the same order as one LPUSH
        # each, and a fraction of the client-side command packing.
        keys: list[str | Attempt] = []
        payloads: dict[str, list[str | bytes]] = {}
        for message in messages:
            if deadline():
                break
            try:
                self._declare(channel, message)
                key, payload = self._envelope(producer, channel, message)
            except self.fallback.outage_errors as exc:
                self.fallback.close()
                return [Attempt(Result.OUTAGE, error_text(exc))] * len(messages)
            except Exception as exc:
                keys.append(_error_attempt(exc))
                continue
            payloads.setdefault(key, []).append(payload)
            keys.append(key)
        try:
            replies = self._send(channel, payloads)
        except self.fallback.outage_errors as exc:
            # The round trip failed: we cannot know which LPUSHes the server ran, so every
            # message is retried later (a possible duplicate, never a loss).
            self.fallback.close()
            return [Attempt(Result.OUTAGE, error_text(exc))] * len(messages)
        done = [k if isinstance(k, Attempt) else replies[k] for k in keys]
        return done + [Attempt(Result.SKIPPED)] * (len(messages) - len(done))

    def _send(self, channel: Any, payloads: dict[str, list[str | bytes]]) -> dict[str, Attempt]:
        if not payloads:
            return {}
        pipe = channel.client.pipeline(transaction=False)
        for key, values in payloads.items():
            pipe.lpush(key, *values)
        results = pipe.execute(raise_on_error=False)
        return {key: _reply_attempt(reply) for key, reply in zip(payloads, results, strict=True)}


def _error_attempt(exc: BaseException) -> Attempt:
    # Out of memory, read-only replica...: Redis refuses everyone, so no retry is spent.
    kind = Result.OUTAGE if broker_refuses_writes(exc) else Result.FAILED
    return Attempt(kind, error_text(exc))


def _reply_attempt(reply: Any) -> Attempt:
    if isinstance(reply, Exception):
        return _error_attempt(reply)
    return Attempt(Result.PUBLISHED)
