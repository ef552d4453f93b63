"""What the admin, outbox_list and outbox_consume_dead show of arguments: redacted, never too long.

With OUTBOX_NOTIFY_REDACT set, its callable decides what is shown. When it (or importing it)
fails, the placeholder FAILED is shown: a failing redactor must never leak the raw values.
Without it, `mask_secrets` hides the values under keys that look secret (as Django's error
pages hide settings named like API, TOKEN, SECRET, PASS). Either way the arguments are shown
as JSON cut to MAX_LENGTH characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from outbox_notify import conf

log = structlog.get_logger("outbox_notify")

FAILED = "<redaction failed>"
MAX_LENGTH = 300  # characters of the args and of the kwargs shown
ELLIPSIS = "…"
MASK = "********"  # what mask_secrets shows in place of a secret value (Django's choice too)

# A key is secret when, lowercased with camelCase and punctuation turned into "_", it contains
# one of these (`author` and `authority` excepted), or one of the short words as a whole word.
SECRET_KEY = re.compile(
    r"pass|pwd|secret|token|bearer|jwt|auth(?!or(?!i[sz]))|credential|api_?key|private_?key"
    r"|access_?key|signing_?key|signature|cookie|session|creditcard|debitcard|(?<![a-z])card"
    r"|cvv|cvc|(?<![a-z])(?:pin|ssn|iban|otp)(?![a-z])"
)
_CAMEL_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NOT_WORD = re.compile(r"[^a-z0-9]+")


def is_secret_key(key: object) -> bool:
    """Whether mask_secrets hides the value under this dict key."""
    words = _NOT_WORD.sub("_", _CAMEL_HUMP.sub("_", str(key)).lower())
    return SECRET_KEY.search(words) is not None


def _masked(value: Any) -> Any:
    """`value` with every dict value under a secret-looking key replaced by MASK, at any depth."""
    if isinstance(value, Mapping):
        return {k: MASK if is_secret_key(k) else _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(item) for item in value]
    return value


def mask_secrets(
    task_name: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """The redactor used without OUTBOX_NOTIFY_REDACT: secret-looking keys' values masked.

    Keyword arguments and dict keys at any depth of args and kwargs are matched against
    SECRET_KEY. A positional value is shown as it is, since nothing names it: redact those with
    your own OUTBOX_NOTIFY_REDACT (which may call this function for the rest).
    """
    return _masked(list(args)), _masked(dict(kwargs))


def truncate(text: str, limit: int = MAX_LENGTH) -> str:
    """`text` cut to at most `limit` characters, the cut marked with an ellipsis."""
    if len(text) <= limit:
        return text
    return text[: max(limit - len(ELLIPSIS), 0)] + ELLIPSIS


def redact(
    task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]] | None:
    """The arguments as the redactor returns them (mask_secrets without one); None on failure."""
    try:
        redactor = conf.redactor() or mask_secrets
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
