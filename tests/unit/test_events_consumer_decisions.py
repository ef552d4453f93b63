"""What a consumer decides without a database: undecodable bodies, header numbers, reasons."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox_notify.events import Consumer
from outbox_notify.events import envelope as wire
from outbox_notify.events.consumer import Outcome
from outbox_notify.events.delivery import MAX_REASON, _clip, _number


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 1.0), (3, 3.0), ("4", 4.0), (2.5, 2.5), (True, 1.0), ("soon", 1.0), ([2], 1.0)],
)
def test_a_header_number_falls_back_to_the_default_when_it_is_not_one(
    value: object, expected: float
) -> None:
    """x-outbox-attempt from another producer may be anything: only real numbers count."""
    assert _number(value, 1.0) == expected


def test_a_reason_is_one_line_and_bounded() -> None:
    """Reasons travel in headers: folded onto one line and cut at MAX_REASON characters."""
    assert _clip("a\n  b\tc") == "a b c"
    long = _clip("x" * (MAX_REASON + 50))
    assert len(long) == MAX_REASON
    assert long.endswith("…")


def test_an_undecodable_body_keeps_what_can_still_be_read_for_the_logs() -> None:
    """A CloudEvent without specversion: undecodable, its id and type still reported."""
    result = Consumer("unit", exchange="x").process(b'{"id": "e1", "type": "t"}')
    assert result.outcome is Outcome.UNDECODABLE
    assert (result.event_id, result.event_type) == ("e1", "t")
    assert result.reason == "missing or non-string attribute(s): specversion, source"


def test_a_type_without_a_handler_is_undecodable_without_touching_the_database() -> None:
    """No handler, no fallback: the reason names the consumer and the type."""
    body = wire.encode(
        wire.Envelope(
            id="e2",
            source="/s",
            type="nobody.Handles",
            time=datetime.now(UTC),
            data=None,
        )
    )
    result = Consumer("unit", exchange="x").process(body)
    assert result.outcome is Outcome.UNDECODABLE
    assert result.reason == "consumer 'unit' has no handler for event type 'nobody.Handles'"


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", float("inf"), "1e999"])
def test_a_header_number_that_is_not_finite_is_the_default(value: object) -> None:
    """x-outbox-attempt: "inf" must not crash settle() (int(inf) raises)."""
    assert _number(value, 1.0) == 1.0
