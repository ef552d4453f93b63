"""JSON for the relay's hot path: orjson when installed (`outbox-notify[fast]`), else json.

Only plain JSON goes through here (the callers route anything kombu tagged, such as
datetimes, through kombu's own encoder). orjson refuses a few things the standard library
accepts (integers beyond 64 bits, for one); those fall back to the standard library, so
the output is always valid JSON that any Celery worker decodes.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - depends on the installed extras
    orjson = None  # type: ignore[assignment]

AVAILABLE = orjson is not None


def loads(text: str) -> Any:
    """Decode JSON text."""
    if orjson is not None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def dumps(value: Any) -> str | bytes:
    """Encode to JSON (bytes from orjson, str from the standard library)."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:
            pass
    return json.dumps(value)
