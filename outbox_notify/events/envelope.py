"""The wire format of a domain event: a CloudEvents 1.0 message in structured JSON mode.

Both sides share this module: the relay publishes `encode(envelope)` with the content type
`CONTENT_TYPE` and the headers of `binding_headers(envelope)`; a consumer turns a body back
into an `Envelope` with `decode()`, which says why when it cannot (the consumer dead-letters
such a message with that reason instead of redelivering it forever).

Headers follow the CloudEvents AMQP binding's naming (`cloudEvents_<attribute>`), so a
consumer can route or filter on an event's type without parsing its body; in structured mode
the body stays the whole truth.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kombu.utils import json as kombu_json

from outbox_notify.exceptions import OutboxNotifyError

SPECVERSION = "1.0"
CONTENT_TYPE = "application/cloudevents+json"
DATA_CONTENT_TYPE = "application/json"
HEADER_PREFIX = "cloudEvents_"
REQUIRED = ("specversion", "id", "source", "type")
# the attributes that also travel as headers (strings only: every AMQP client reads them)
_HEADER_ATTRIBUTES = ("specversion", "id", "source", "type", "time", "subject")

__all__ = [
    "CONTENT_TYPE",
    "SPECVERSION",
    "Envelope",
    "UndecodableEvent",
    "binding_headers",
    "decode",
    "encode",
    "identify",
    "new_event_id",
]


class UndecodableEvent(OutboxNotifyError):
    """A message body that is not a CloudEvents 1.0 structured JSON event; the text says why."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Envelope:
    """One event as CloudEvents describes it.

    `data` holds values kombu's JSON encodes (the rules task arguments follow: a datetime,
    UUID or Decimal travels as kombu's typed object and comes back as itself on decode).
    """

    id: str
    source: str
    type: str
    time: datetime
    data: Any
    subject: str | None = None
    datacontenttype: str = DATA_CONTENT_TYPE
    specversion: str = SPECVERSION

    def attributes(self) -> dict[str, Any]:
        """The CloudEvents attributes as the JSON object the body carries."""
        out: dict[str, Any] = {
            "specversion": self.specversion,
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "time": _rfc3339(self.time),
            "datacontenttype": self.datacontenttype,
        }
        if self.subject is not None:
            out["subject"] = self.subject
        out["data"] = self.data
        return out


def new_event_id() -> str:
    """A fresh event id (a UUID4 string): unique per event, stored with it, so redeliveries share it."""
    return str(uuid.uuid4())


def _rfc3339(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError("an event's time must be timezone-aware")
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def encode(envelope: Envelope) -> bytes:
    """The structured-mode body: one JSON object in UTF-8, encoded by kombu's JSON."""
    text: str = kombu_json.dumps(envelope.attributes())
    return text.encode("utf-8")


def binding_headers(envelope: Envelope) -> dict[str, str]:
    """`cloudEvents_*` headers that mirror the body's attributes (AMQP binding names)."""
    attributes = envelope.attributes()
    return {
        HEADER_PREFIX + name: str(attributes[name])
        for name in _HEADER_ATTRIBUTES
        if attributes.get(name) is not None
    }


def _parse_time(value: Any) -> datetime:
    if not isinstance(value, str):
        raise UndecodableEvent(f"'time' must be an RFC 3339 string, got {value!r:.80}")
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise UndecodableEvent(f"'time' is not RFC 3339: {value!r:.80}") from exc
    if moment.tzinfo is None:
        raise UndecodableEvent(f"'time' has no UTC offset: {value!r:.80}")
    return moment


def _object(body: bytes | str) -> Mapping[str, Any]:
    try:
        parsed = kombu_json.loads(body)
    except Exception as exc:  # any body a publisher sends must be refusable
        # Besides bad JSON: kombu's typed objects with bad values ({"__type__": "decimal",
        # "__value__": "x"} raises InvalidOperation), nesting deep enough for RecursionError.
        raise UndecodableEvent(
            f"body is not JSON kombu can decode: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(parsed, dict):
        raise UndecodableEvent(f"body is a JSON {type(parsed).__name__}, not an object")
    return parsed


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Identity:
    """What a body says about the event it carries, each None where it cannot be read."""

    id: str | None
    source: str | None
    type: str | None


def identify(body: bytes | str) -> Identity:
    """The id, source and type a body names, even one `decode` refuses (for logs, dead letters)."""
    try:
        parsed = kombu_json.loads(body)
    except Exception:  # only to describe a body: whatever it is, say what can be read
        parsed = None
    if not isinstance(parsed, dict):
        return Identity(id=None, source=None, type=None)
    found = [parsed.get(name) for name in ("id", "source", "type")]
    event_id, source, event_type = (value if isinstance(value, str) else None for value in found)
    return Identity(id=event_id, source=source, type=event_type)


def decode(body: bytes | str) -> Envelope:
    """The envelope a structured-mode body carries; UndecodableEvent with the reason if none."""
    attributes = _object(body)
    missing = [name for name in REQUIRED if not isinstance(attributes.get(name), str)]
    if missing:
        raise UndecodableEvent(f"missing or non-string attribute(s): {', '.join(missing)}")
    if attributes["specversion"] != SPECVERSION:
        raise UndecodableEvent(f"specversion {attributes['specversion']!r} is not {SPECVERSION}")
    if "time" not in attributes:
        raise UndecodableEvent("missing attribute: time")
    subject = attributes.get("subject")
    return Envelope(
        id=attributes["id"],
        source=attributes["source"],
        type=attributes["type"],
        time=_parse_time(attributes["time"]),
        data=attributes.get("data"),
        subject=subject if isinstance(subject, str) else None,
        datacontenttype=str(attributes.get("datacontenttype", DATA_CONTENT_TYPE)),
    )
