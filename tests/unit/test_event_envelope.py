"""The CloudEvents envelope: what the relay publishes is what a consumer decodes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from outbox_notify.events.envelope import (
    CONTENT_TYPE,
    Envelope,
    UndecodableEvent,
    binding_headers,
    decode,
    encode,
    new_event_id,
)


def _envelope(**changes: object) -> Envelope:
    fields: dict[str, object] = {
        "id": new_event_id(),
        "source": "/shop",
        "type": "shop.events.OrderPlaced",
        "time": datetime(2026, 11, 26, 12, 0, 0, 123456, tzinfo=UTC),
        "data": {"order_id": 7, "lines": [1, 2], "note": "café"},
    }
    fields.update(changes)
    return Envelope(**fields)  # type: ignore[arg-type]


def test_round_trip_is_lossless() -> None:
    """decode(encode(e)) gives back e, subject included."""
    envelope = _envelope(subject="order/7")
    assert decode(encode(envelope)) == envelope


def test_body_is_structured_mode_json() -> None:
    """The body carries every required CloudEvents attribute, with time in RFC 3339 UTC."""
    body = json.loads(encode(_envelope()))
    assert body["specversion"] == "1.0"
    assert body["datacontenttype"] == "application/json"
    assert body["time"] == "2026-11-26T12:00:00.123456Z"
    assert set(body) == {"specversion", "id", "source", "type", "time", "datacontenttype", "data"}
    assert CONTENT_TYPE == "application/cloudevents+json"


def test_time_is_normalised_to_utc() -> None:
    """An aware time in another zone is written as the same instant in UTC."""
    local = datetime(2026, 11, 26, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    assert json.loads(encode(_envelope(time=local)))["time"] == "2026-11-26T12:00:00Z"


def test_naive_time_is_refused() -> None:
    """A naive time cannot be placed on a timeline, so it is refused."""
    with pytest.raises(ValueError, match="timezone-aware"):
        encode(_envelope(time=datetime(2026, 11, 26)))


def test_binding_headers_mirror_the_attributes() -> None:
    """cloudEvents_* headers carry the attributes as strings, data excluded."""
    envelope = _envelope()
    headers = binding_headers(envelope)
    assert headers["cloudEvents_id"] == envelope.id
    assert headers["cloudEvents_type"] == "shop.events.OrderPlaced"
    assert headers["cloudEvents_specversion"] == "1.0"
    assert "cloudEvents_data" not in headers


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON list"),
        (b'{"id": "1", "source": "s", "type": "t", "time": "2026-01-01T00:00:00Z"}', "specversion"),
        (b'{"specversion": "0.3", "id": "1", "source": "s", "type": "t"}', "is not 1.0"),
        (b'{"specversion": "1.0", "id": "1", "source": "s", "type": "t"}', "time"),
        (
            b'{"specversion": "1.0", "id": "1", "source": "s", "type": "t", "time": "yesterday"}',
            "RFC 3339",
        ),
        (
            b'{"specversion": "1.0", "id": "1", "source": "s", "type": "t", "time": "2026-01-01T00:00:00"}',
            "UTC offset",
        ),
    ],
)
def test_undecodable_bodies_say_why(body: bytes, reason: str) -> None:
    """Each malformed body raises UndecodableEvent naming what is wrong."""
    with pytest.raises(UndecodableEvent, match=reason):
        decode(body)


def test_data_follows_kombu_json_rules() -> None:
    """Datetimes and UUIDs in data come back as themselves, as task arguments do."""
    import uuid

    moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    ident = uuid.uuid4()
    envelope = _envelope(data={"at": moment, "ref": ident})
    assert decode(encode(envelope)).data == {"at": moment, "ref": ident}
