"""What admin and logs show of task arguments: redacted, truncated, never leaked on failure."""

from __future__ import annotations

from typing import Any

import structlog
from django.test import override_settings

from outbox_notify import redaction

SECRET = "4111-1111-1111-1111"


def mask_card(
    task_name: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """A redactor that hides the `card` kwarg and keeps the rest."""
    return args, {**kwargs, "card": "****"} if "card" in kwargs else kwargs


def broken(task_name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor that fails, with the secret in its message."""
    raise ValueError(f"cannot redact {kwargs}")


def wrong_shape(task_name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor that returns something other than (args, kwargs)."""
    return "nope"


def test_without_a_redactor_arguments_are_shown_as_json() -> None:
    """No OUTBOX_NOTIFY_REDACT: args and kwargs appear as JSON."""
    assert redaction.display("t", [1, "é"], {"k": None}) == 'args=[1, "é"] kwargs={"k": null}'


def test_long_arguments_are_truncated() -> None:
    """Each of args and kwargs is cut to the limit, the cut marked with an ellipsis."""
    shown = redaction.display("t", ["x" * 1000], {"k": "y" * 1000}, limit=20)
    args_part, kwargs_part = shown.split(" kwargs=")
    assert args_part == "args=" + '["' + "x" * 17 + "…"
    assert len(kwargs_part) == 20
    assert kwargs_part.endswith("…")


def test_truncate_leaves_short_text_alone() -> None:
    """Text within the limit is returned as is."""
    assert redaction.truncate("abc", 3) == "abc"


@override_settings(OUTBOX_NOTIFY_REDACT="tests.unit.test_redaction.mask_card")
def test_the_configured_redactor_decides_what_is_shown() -> None:
    """OUTBOX_NOTIFY_REDACT's callable receives the task name and arguments; its output shows."""
    shown = redaction.display("shop.charge", [7], {"card": SECRET})
    assert SECRET not in shown
    assert shown == 'args=[7] kwargs={"card": "****"}'


@override_settings(OUTBOX_NOTIFY_REDACT="tests.unit.test_redaction.broken")
def test_a_failing_redactor_shows_a_placeholder_and_logs_without_values() -> None:
    """When the redactor raises, the placeholder is shown and the log event carries no values."""
    with structlog.testing.capture_logs() as logs:
        shown = redaction.display("shop.charge", [SECRET], {"card": SECRET})
    assert shown == "<redaction failed>"
    assert [e["event"] for e in logs] == ["outbox.redaction_failed"]
    assert SECRET not in repr(logs)


@override_settings(OUTBOX_NOTIFY_REDACT="tests.unit.test_redaction.wrong_shape")
def test_a_redactor_returning_the_wrong_shape_counts_as_failed() -> None:
    """A redactor that does not return (args, kwargs) is treated as a failure, not shown raw."""
    assert redaction.display("t", [SECRET], {}) == "<redaction failed>"


@override_settings(OUTBOX_NOTIFY_REDACT="tests.unit.no_such_module.redact")
def test_an_unimportable_redactor_counts_as_failed() -> None:
    """A redactor path that does not import hides the values instead of showing them raw."""
    assert redaction.display("t", [SECRET], {}) == "<redaction failed>"
