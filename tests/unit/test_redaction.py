"""What admin and logs show of task arguments: redacted, truncated, never leaked on failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
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


def show_all(
    task_name: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """A redactor that shows everything (a user's explicit choice)."""
    return args, kwargs


def test_without_a_redactor_secret_looking_keys_are_masked_at_any_depth() -> None:
    """No OUTBOX_NOTIFY_REDACT: values under password/token/card/... keys show as ********."""
    shown = redaction.display(
        "shop.charge",
        [7, {"user": "ann", "auth": {"apiKey": "k-123"}}, [{"card_number": SECRET}]],
        {"password": "hunter2", "amount": 5, "headers": {"Authorization": "Bearer xyz"}},
    )
    for secret in ("k-123", SECRET, "hunter2", "Bearer xyz"):
        assert secret not in shown
    assert shown == (
        'args=[7, {"user": "ann", "auth": "********"}, [{"card_number": "********"}]] '
        'kwargs={"password": "********", "amount": 5, "headers": {"Authorization": "********"}}'
    )


def test_an_event_s_data_is_masked_the_same_way() -> None:
    """Without a redactor an event's data keeps its shape and loses its secret values."""
    shown = redaction.display_event("shop.paid", {"order": 7, "card": {"number": SECRET}})
    assert shown == 'data={"order": 7, "card": "********"}'


@pytest.mark.parametrize(
    "key",
    [
        "password", "db_password", "passwd", "pwd", "secret", "client_secret", "token",
        "accessToken", "api_key", "apiKey", "X-Api-Key", "auth", "Authorization",
        "credentials", "card", "creditCard", "cvv", "pin", "userPIN", "ssn", "iban", "otp",
        "sessionid", "cookie", "signature", "private_key", "AWS_ACCESS_KEY",
    ],
)  # fmt: skip
def test_secret_looking_keys(key: str) -> None:
    """Keys that name credentials, card data or sessions count as secret, in any case or style."""
    assert redaction.is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "author", "author_id", "authority", "order_id", "amount", "key", "cache_key",
        "ordering_key", "shipping", "spinner", "opinion", "classname", "footprint", "discard",
        "postcard", "company", "email",
    ],
)  # fmt: skip
def test_ordinary_keys_are_shown(key: str) -> None:
    """Keys that merely contain the letters of a secret word (author, shipping) are shown."""
    assert not redaction.is_secret_key(key)


@override_settings(OUTBOX_NOTIFY_REDACT="tests.unit.test_redaction.show_all")
def test_a_configured_redactor_replaces_the_default_masking() -> None:
    """OUTBOX_NOTIFY_REDACT is the user's override: a redactor that shows all shows all."""
    shown = redaction.display("t", [], {"password": "hunter2"})
    assert shown == 'args=[] kwargs={"password": "hunter2"}'


def test_mask_secrets_can_be_called_by_a_redactor_of_one_s_own() -> None:
    """mask_secrets is a redactor itself, so a custom one can apply it to what it leaves."""
    args, kwargs = redaction.mask_secrets("t", ["4111"], {"token": "t-1", "n": 1})
    assert (args, kwargs) == (["4111"], {"token": redaction.MASK, "n": 1})


def test_the_redactor_security_md_shows_works_as_described() -> None:
    """docs/security.md's example hides charge's positional card and masks the rest."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    code = page.split("```python\n# proj/redact.py\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "security.md", "exec"), namespace)  # noqa: S102 - our own docs
    outbox = namespace["outbox"]
    assert outbox("shop.tasks.charge", [7, SECRET], {"token": "t-1"}) == (
        [7, "****"],
        {"token": redaction.MASK},
    )
    assert outbox("shop.tasks.other", [SECRET], {}) == ([SECRET], {})
