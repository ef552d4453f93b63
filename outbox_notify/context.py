"""Captures the request's structlog and Sentry context at enqueue, for use at publish."""

from __future__ import annotations

from typing import Any

import structlog

from outbox_notify import conf


def _structlog_context() -> dict[str, Any]:
    keys = conf.structlog_context_keys()
    if keys is not None and not keys:
        return {}
    values = structlog.contextvars.get_contextvars()
    if keys is None:
        return dict(values)
    return {k: v for k, v in values.items() if k in keys}


def _sentry_context() -> dict[str, str]:
    try:
        import sentry_sdk
    except ImportError:
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


def capture() -> dict[str, Any]:
    """The context to store with a new outbox row (only the parts that are non-empty)."""
    context: dict[str, Any] = {}
    structlog_values = _structlog_context()
    if structlog_values:
        context["structlog"] = structlog_values
    sentry = _sentry_context()
    if sentry:
        context["sentry"] = sentry
    return context
