"""OUTBOX_NOTIFY_MAX_MESSAGE_BYTES: a task too big for the broker fails at the call, writing nothing."""

from __future__ import annotations

import re

import pytest
from django.db import connection, transaction
from django.test import override_settings

from outbox_notify import bulk, conf, limits
from outbox_notify.exceptions import SerializationError
from outbox_notify.models import OutboxMessage
from tests.celery_app import add

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the point is what the caller's real transaction keeps after the refusal.

MIB = 1 << 20


def _stored_size(row: OutboxMessage) -> int:
    """What the limit measures, read back from the stored texts (json keeps them verbatim)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT octet_length(args::text) + octet_length(kwargs::text)"
            " + octet_length(options::text) FROM outbox_notify_message_v1 WHERE id = %s",
            [row.id],
        )
        return int(cursor.fetchone()[0])


def test_the_default_limit_refuses_a_task_over_ten_mebibytes_and_writes_nothing() -> None:
    """With the default limit an 11 MiB argument raises at the call; the transaction goes on."""
    assert conf.max_message_bytes() == 10 * MIB
    with transaction.atomic():
        add.delay(1, 1)
        with pytest.raises(SerializationError) as excinfo:
            add.delay("x" * (11 * MIB), 1)
        add.delay(2, 2)
    message = str(excinfo.value)
    assert "'tests.add'" in message
    assert "10,485,760 bytes (OUTBOX_NOTIFY_MAX_MESSAGE_BYTES)" in message
    size = int(re.search(r"is ([\d,]+) bytes", message).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert size > 11 * MIB
    assert [row.args for row in OutboxMessage.objects.order_by("id")] == [[1, 1], [2, 2]]


def test_a_task_at_the_limit_is_written_and_one_character_more_is_not() -> None:
    """The limit is inclusive and counts the stored JSON of args, kwargs and options."""
    add.delay("x" * 1000, 1)
    row = OutboxMessage.objects.get()
    exact = _stored_size(row)
    OutboxMessage.objects.all().delete()
    with override_settings(OUTBOX_NOTIFY_MAX_MESSAGE_BYTES=exact):
        add.delay("x" * 1000, 1)
        # One more character in the argument is one more in args and in the argsrepr header.
        with pytest.raises(SerializationError, match=f"is {exact + 2:,} bytes"):
            add.delay("x" * 1001, 1)
    assert OutboxMessage.objects.count() == 1


def test_none_turns_the_limit_off() -> None:
    """OUTBOX_NOTIFY_MAX_MESSAGE_BYTES = None accepts any size (the broker's limit remains)."""
    with override_settings(OUTBOX_NOTIFY_MAX_MESSAGE_BYTES=None):
        add.delay("x" * (11 * MIB), 1)
    assert OutboxMessage.objects.count() == 1


def test_kwargs_and_options_count_too() -> None:
    """A big keyword argument or header is measured like a big positional one."""
    with override_settings(OUTBOX_NOTIFY_MAX_MESSAGE_BYTES=4096):
        with pytest.raises(SerializationError):
            add.apply_async((1,), {"y": "x" * 5000})
        with pytest.raises(SerializationError):
            add.apply_async((1, 2), headers={"big": "x" * 5000})
    assert OutboxMessage.objects.count() == 0


@pytest.mark.parametrize(
    ("texts", "expected"),
    [(("ab", b"cd"), 4), (("é" * 3,), 6), (("€",), 3)],
    ids=["ascii-and-bytes", "two-byte", "three-byte"],
)
def test_sizes_are_utf8_bytes(texts: tuple[str | bytes, ...], expected: int) -> None:
    """Non-ASCII text is measured in UTF-8 bytes whenever that could reach the limit."""
    assert limits.message_size(*texts, limit=expected) == expected
    assert sum(limits.text_bytes(text) for text in texts) == expected


def test_bulk_enqueue_refuses_an_oversized_task_at_its_call_too() -> None:
    """Inside outbox_notify.bulk() (templated fast path included) the same limit applies."""
    with override_settings(OUTBOX_NOTIFY_MAX_MESSAGE_BYTES=4096), transaction.atomic(), bulk():
        for number in range(3):
            add.delay(number, 1)  # the first builds the template, the others fill it
        with pytest.raises(SerializationError, match="OUTBOX_NOTIFY_MAX_MESSAGE_BYTES"):
            add.delay("x" * 5000, 1)
        add.delay(9, 9)
    assert sorted(row.args[0] for row in OutboxMessage.objects.all()) == [0, 1, 2, 9]
