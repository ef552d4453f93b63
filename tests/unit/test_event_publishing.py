"""Event rows: the type and data publish() derives, and the message the relay builds from a row."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import uuid
from typing import Any, ClassVar

import pytest
from kombu import Exchange

from outbox_notify.events import envelope as wire
from outbox_notify.events.publishing import EventError, event_row, to_envelope
from outbox_notify.exceptions import UndecodableMessage
from outbox_notify.relay import messages
from outbox_notify.relay.store import ClaimedRow
from outbox_notify.serialization import EVENT_VERSION, SCHEMA_VERSION

NOW = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


@dataclasses.dataclass
class Line:
    """A nested dataclass: asdict turns it into an object."""

    sku: str
    qty: int


@dataclasses.dataclass
class OrderPlaced:
    """An event named after its class."""

    order_id: int
    lines: list[Line]
    total: decimal.Decimal


@dataclasses.dataclass
class Renamed:
    """An event that declares its type."""

    event_type: ClassVar[str] = "shop.order.renamed"
    name: str


def _claimed(row: Any) -> ClaimedRow:
    return ClaimedRow(
        9, row.task_id, row.task_name, row.args, row.kwargs, row.options, row.context, 0,
        row.schema_version, NOW,
    )  # fmt: skip


def test_dataclass_type_is_its_qualified_name_and_data_its_asdict() -> None:
    """`module.QualName` unless the class declares event_type; data is dataclasses.asdict."""
    event = OrderPlaced(1, [Line("a", 2)], decimal.Decimal("3.10"))
    envelope = to_envelope(event, source="/s")
    assert envelope.type == f"{__name__}.OrderPlaced"
    assert envelope.data == {"order_id": 1, "lines": [{"sku": "a", "qty": 2}], "total": event.total}
    assert to_envelope(Renamed("x"), source="/s").type == "shop.order.renamed"


def test_each_event_gets_a_fresh_id_and_an_aware_utc_time() -> None:
    """Ids differ per event; time is the publish moment in UTC; a given id and time are kept."""
    before = dt.datetime.now(dt.UTC)
    first, second = (to_envelope({"type": "t"}, source="/s") for _ in range(2))
    assert first.id != second.id
    assert uuid.UUID(first.id)
    assert first.time.tzinfo is dt.UTC
    assert before <= first.time <= dt.datetime.now(dt.UTC)
    paris = dt.timezone(dt.timedelta(hours=1))
    given = to_envelope({"type": "t", "id": "e-1", "time": NOW.astimezone(paris)}, source="/s")
    assert (given.id, given.time, given.time.tzinfo) == ("e-1", NOW, dt.UTC)


def test_event_row_layout() -> None:
    """Schema version 3: id, type, data in args, attributes in kwargs, routing in options."""
    envelope = to_envelope({"type": "shop.placed", "data": {"n": 1}, "subject": "o-1"}, source="/s")
    row = event_row(envelope, exchange="shop", headers={"x-a": 1})
    assert (row.task_id, row.task_name, row.schema_version) == (envelope.id, "shop.placed", 3)
    assert json.loads(row.args) == {"n": 1}
    assert list(json.loads(row.kwargs)) == [
        "specversion", "id", "source", "type", "time", "datacontenttype", "subject",
    ]  # fmt: skip
    assert json.loads(row.options) == {
        "headers": {**wire.binding_headers(envelope), "x-a": 1},
        "exchange": "shop",
        "routing_key": "shop.placed",
    }
    assert EVENT_VERSION <= SCHEMA_VERSION  # a relay that reads the newest layout reads events


DATA: dict[str, Any] = {
    "object": {"a": 1, "nested": {"b": [1, 2.5, None, True]}},
    "tagged": {"when": NOW, "id": uuid.UUID(int=3), "price": decimal.Decimal("1.10")},
    "non-ascii": {"name": "caf\u00e9 \u2603 \U0001f600"},
    "null": None,
    "scalar": "just text",
    "list": [1, "two"],
}


@pytest.mark.parametrize("case", list(DATA))
@pytest.mark.parametrize("subject", [None, "s-1"])
def test_relay_body_is_byte_for_byte_the_envelope_encoding(case: str, subject: str | None) -> None:
    """The body the relay splices from the stored texts equals envelope.encode() exactly."""
    envelope = to_envelope({"type": "t", "data": DATA[case], "subject": subject}, source="/s")
    message = messages.prepare(_claimed(event_row(envelope, exchange="x")), NOW)
    assert message.body.encode("utf-8") == wire.encode(envelope)
    assert wire.decode(message.body) == dataclasses.replace(envelope, data=DATA[case])
    assert message.content_type == wire.CONTENT_TYPE == messages.EVENT_CONTENT_TYPE


def test_relay_message_routing_of_a_named_and_a_configured_exchange() -> None:
    """A name becomes a durable topic exchange; an Exchange is kept as configured; persistent."""
    envelope = to_envelope({"type": "shop.placed"}, source="/s")
    named = messages.prepare(_claimed(event_row(envelope, exchange="shop")), NOW)
    assert named.spec.declare_exchange == Exchange("shop", type="topic", durable=True)
    assert (named.spec.exchange, named.spec.routing_key) == ("shop", "shop.placed")
    assert named.spec.delivery_mode == 2
    fanout = Exchange("fan", type="fanout", durable=False, arguments={"alternate-exchange": "ae"})
    row = event_row(envelope, exchange=fanout, routing_key="")
    configured = messages.prepare(_claimed(row), NOW)
    assert configured.spec.declare_exchange == fanout
    assert configured.spec.declare_exchange.arguments == {"alternate-exchange": "ae"}  # type: ignore[union-attr]
    assert (configured.spec.exchange, configured.spec.routing_key) == ("fan", "")


@pytest.mark.parametrize(
    ("column", "text"),
    [
        ("options", '{"exchange": "x", "routing_key": "k"}'),
        ("options", '{"headers": {}, "exchange": "", "routing_key": "k"}'),
        ("options", '{"headers": {}, "exchange": "x", "routing_key": 5}'),
        ("kwargs", '{"specversion": "1.0", "id": "i"}'),
        ("kwargs", "[1]"),
    ],
)
def test_a_hand_made_event_row_the_relay_cannot_send_is_undecodable(column: str, text: str) -> None:
    """A row missing what an event needs is refused with a reason (it is dead-lettered)."""
    row = event_row(to_envelope({"type": "t"}, source="/s"), exchange="x")
    with pytest.raises(UndecodableMessage):
        messages.prepare(_claimed(dataclasses.replace(row, **{column: text})), NOW)


def test_event_errors_are_serialization_errors() -> None:
    """Bad events raise the contract's SerializationError (a TypeError), and ValueError too."""
    with pytest.raises(EventError) as raised:
        to_envelope(42, source="/s")
    assert isinstance(raised.value, TypeError)
    assert isinstance(raised.value, ValueError)
