"""Captures the request's structlog, Sentry and OpenTelemetry context at enqueue, for publish.

This runs on every enqueue, so it decides as little as possible per call: Sentry and
OpenTelemetry are looked up in `sys.modules` (an SDK nobody imported cannot have been
initialised, no span can be current without `opentelemetry.trace` imported, and a failed
`import` is not cached by Python, so trying it per call would walk `sys.path` each time).
"""

from __future__ import annotations

import sys
from typing import Any

import structlog

_get_contextvars = structlog.contextvars.get_contextvars


class _FromSettings:
    """Marks "read OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS" (None already means "all keys")."""


_FROM_SETTINGS = _FromSettings()


def structlog_context(keys: frozenset[str] | None) -> dict[str, Any]:
    """The bound structlog contextvars: all of them (keys None), only `keys`, or none."""
    if keys is not None and not keys:
        return {}
    values = _get_contextvars()
    if keys is None or not values:
        return values
    return {k: v for k, v in values.items() if k in keys}


def sentry_context() -> dict[str, str]:
    """The active Sentry trace as `sentry-trace`/`baggage` headers; {} without a client."""
    sentry_sdk = sys.modules.get("sentry_sdk")
    if sentry_sdk is None:
        return {}
    # Without a configured client the SDK still invents a trace id; propagating it would
    # only add headers nobody reads.
    client = sentry_sdk.get_client()
    if not client.is_active() or not client.dsn:
        return {}
    headers: dict[str, str] = {}
    traceparent = sentry_sdk.get_traceparent()
    baggage = sentry_sdk.get_baggage()
    if traceparent:
        headers["sentry-trace"] = traceparent
    if baggage:
        headers["baggage"] = baggage
    return headers


def otel_context() -> dict[str, str]:
    """The current OpenTelemetry span as the headers its propagators write (W3C `traceparent`,
    `tracestate` by default); {} when no valid span is current or the API is not imported."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return {}
    from opentelemetry import propagate

    # The global propagators, as Celery's instrumentation uses for inject and extract.
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


SENTRY_HEADERS = ("sentry-trace", "baggage")


def carries_sentry_trace(headers: Any) -> bool:
    """Whether message headers already carry the Sentry trace (Sentry's Celery integration).

    The relay adds the captured trace only to a message without these headers, so there is
    nothing to capture for one that has them.
    """
    return bool(headers) and all(key in headers for key in SENTRY_HEADERS)


def capture(
    keys: frozenset[str] | _FromSettings | None = _FROM_SETTINGS, *, sentry: bool = True
) -> dict[str, Any]:
    """The context to store with a new outbox row (only the parts that are non-empty).

    `keys` is OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS; the write side passes the value it read
    once (see `outbox_notify._write.settings`). `sentry=False` skips the Sentry trace (the message
    headers carry it already).
    """
    if isinstance(keys, _FromSettings):
        from outbox_notify._write import settings as write_settings

        keys = write_settings.current().structlog_keys
    context: dict[str, Any] = {}
    structlog_values = structlog_context(keys)
    if structlog_values:
        context["structlog"] = structlog_values
    trace = sentry_context() if sentry else None
    if trace:
        context["sentry"] = trace
    otel = otel_context()
    if otel:
        context["otel"] = otel
    return context
