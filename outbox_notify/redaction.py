"""What admin pages and logs show of a task's arguments: redacted, and never too long.

With OUTBOX_NOTIFY_REDACT set, its callable decides what is shown. When it (or importing it)
fails, the placeholder FAILED is shown: a failing redactor must never leak the raw values.
Without it, the arguments are shown as JSON cut to MAX_LENGTH characters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from outbox_notify import conf

log = structlog.get_logger("outbox_notify")

FAILED = "<redaction failed>"
MAX_LENGTH = 300  # characters of the args and of the kwargs shown
ELLIPSIS = "…"


def truncate(text: str, limit: int = MAX_LENGTH) -> str:
    """`text` cut to at most `limit` characters, the cut marked with an ellipsis."""
    if len(text) <= limit:
        return text
    return text[: max(limit - len(ELLIPSIS), 0)] + ELLIPSIS


def redact(
    task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]] | None:
    """The arguments as the redactor returns them (as given without one); None on failure."""
    try:
        redactor = conf.redactor()
        if redactor is None:
            return list(args), dict(kwargs)
        shown_args, shown_kwargs = redactor(task_name, list(args), dict(kwargs))
        return list(shown_args), dict(shown_kwargs)
    except Exception as exc:
        log.warning("outbox.redaction_failed", task_name=task_name, error=type(exc).__name__)
        return None


def _json(value: Any) -> str:
    """Values as readable JSON (non-ASCII kept, unknown types as str)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def display(
    task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any], limit: int = MAX_LENGTH
) -> str:
    """One line for admin and logs: redacted args and kwargs as JSON, each cut to `limit`."""
    shown = redact(task_name, args, kwargs)
    if shown is None:
        return FAILED
    shown_args, shown_kwargs = shown
    try:
        return f"args={truncate(_json(shown_args), limit)} kwargs={truncate(_json(shown_kwargs), limit)}"
    except (TypeError, ValueError):
        return FAILED


def display_event(event_type: str, data: Any, limit: int = MAX_LENGTH) -> str:
    """One line for a domain event's data, redacted as a task called with `[data]` would be."""
    shown = redact(event_type, [data], {})
    if shown is None or len(shown[0]) != 1:
        return FAILED
    try:
        return f"data={truncate(_json(shown[0][0]), limit)}"
    except (TypeError, ValueError):
        return FAILED
