"""Serialisation of recorded publishes into rows and back, without a database."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu import Exchange, Queue

from outbox_notify import serialization
from outbox_notify.exceptions import ConfigurationError, SerializationError, UndecodableMessage

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _publish_kwargs(**extra: object) -> dict[str, object]:
    base: dict[str, object] = {
        "exchange": "",
        "routing_key": "celery",
        "serializer": "json",
        "compression": None,
        "delivery_mode": 2,
        "declare": [],
        "headers": {"id": "tid", "task": "t.name", "expires": None},
        "retry": True,
        "retry_policy": {"max_retries": 3},
        "correlation_id": "tid",
        "reply_to": "r",
    }
    base.update(extra)
    return base


@given(
    args=st.lists(json_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
def test_args_and_kwargs_round_trip_through_json_text(
    args: list[object], kwargs: dict[str, object]
) -> None:
    """Any JSON value survives build_row's encoding unchanged."""
    row = serialization.build_row((args, kwargs, {}), _publish_kwargs(), relative={}, context={})
    assert json.loads(row.args) == args
    assert json.loads(row.kwargs) == kwargs


@given(
    headers=st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k not in {"id", "task"}),
        json_values,
        max_size=4,
    ),
    priority=st.none() | st.integers(0, 9),
    routing_key=st.text(max_size=10),
)
def test_options_round_trip(
    headers: dict[str, object], priority: int | None, routing_key: str
) -> None:
    """Headers, properties and routing decode to what was recorded."""
    all_headers = {"id": "tid", "task": "t", **headers}
    row = serialization.build_row(
        ([], {}, {"callbacks": None}),
        _publish_kwargs(headers=all_headers, priority=priority, routing_key=routing_key),
        relative={},
        context={},
    )
    spec = serialization.decode_options(json.loads(row.options))
    assert spec.headers == all_headers
    assert spec.properties["priority"] == priority
    assert spec.routing_key == routing_key
    assert spec.embed == {"callbacks": None}
    assert "retry" not in spec.properties
    assert "retry_policy" not in spec.properties


def test_queue_and_exchange_objects_keep_their_routing() -> None:
    """A kombu Queue/Exchange is rebuilt with its type, routing key and arguments."""
    exchange = Exchange("ex", type="topic", durable=False)
    queue = Queue("q", exchange, routing_key="a.#", queue_arguments={"x-max-priority": 10})
    row = serialization.build_row(
        ([], {}, {}),
        _publish_kwargs(exchange=exchange, declare=[queue], routing_key="a.b"),
        relative={},
        context={},
    )
    spec = serialization.decode_options(json.loads(row.options))
    assert spec.exchange == exchange
    assert spec.exchange.type == "topic"
    [declared] = spec.declare
    assert declared.name == "q"
    assert declared.routing_key == "a.#"
    assert declared.exchange == exchange
    assert declared.queue_arguments == {"x-max-priority": 10}


def test_unserializable_values_raise_serialization_error() -> None:
    """An object kombu's JSON cannot encode raises SerializationError (a TypeError)."""
    with pytest.raises(SerializationError, match="task args"):
        serialization.build_row(([object()], {}, {}), _publish_kwargs(), relative={}, context={})


def test_protocol_1_bodies_are_refused_as_a_configuration_error() -> None:
    """A protocol 1 body is the app's configuration, not the caller's arguments, at fault."""
    with pytest.raises(ConfigurationError, match="task_protocol=1"):
        serialization.build_row({"args": []}, _publish_kwargs(), relative={}, context={})


@pytest.mark.parametrize(
    "bad", [{}, {"headers": []}, {"headers": {}, "embed": 3}, {"headers": {}, "declare": [1]}]
)
def test_malformed_options_are_undecodable(bad: dict[str, object]) -> None:
    """Broken options raise UndecodableMessage, which the relay dead-letters."""
    with pytest.raises(UndecodableMessage):
        serialization.decode_options(bad)


def test_expiration_is_counted_at_publish_time() -> None:
    """The broker TTL is what remains of `expires` when the relay publishes, never negative."""
    now = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
    later = (now + dt.timedelta(seconds=90)).isoformat()
    earlier = (now - dt.timedelta(seconds=5)).isoformat()
    assert serialization.expiration_seconds({"expires": later}, now) == 90.0
    assert serialization.expiration_seconds({"expires": earlier}, now) == 0.0
    assert serialization.expiration_seconds({"expires": None}, now) is None


def test_eta_and_expires_headers_are_read_as_the_worker_reads_them() -> None:
    """A naive header is UTC whatever the zone of `now`; an aware one keeps its zone."""
    naive = dt.datetime(2026, 1, 1, 12, 0)
    assert serialization.header_time(naive.isoformat()) == naive.replace(tzinfo=dt.UTC)
    assert serialization.header_time(naive) == naive.replace(tzinfo=dt.UTC)
    tokyo = dt.datetime(2026, 1, 1, 21, 0, tzinfo=ZoneInfo("Asia/Tokyo"))
    assert serialization.header_time(tokyo.isoformat()) == tokyo
    now_in_new_york = dt.datetime(2026, 1, 1, 6, 59, tzinfo=ZoneInfo("America/New_York"))
    expires = {"expires": naive.isoformat()}  # 12:00 UTC, 60 s after 06:59 in New York
    assert serialization.expiration_seconds(expires, now_in_new_york) == 60.0
    with pytest.raises(ValueError, match="Invalid isoformat"):
        serialization.header_time("next tuesday")


def test_relative_times_accept_numbers_and_timedeltas() -> None:
    """countdown/expires given as seconds or timedelta are remembered as seconds."""
    assert serialization.relative_times({"countdown": 5, "expires": dt.timedelta(minutes=1)}) == {
        "countdown": 5.0,
        "expires": 60.0,
    }
    assert serialization.relative_times({"expires": dt.datetime.now(dt.UTC)}) == {}


quick_values = st.recursive(
    json_scalars | st.floats() | st.datetimes() | st.uuids() | st.decimals(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(st.lists(quick_values, max_size=4) | st.dictionaries(st.text(), quick_values, max_size=4))
def test_the_prebuilt_encoder_gives_kombus_text_and_errors(value: object) -> None:
    """Task arguments encode to the same text, or the same SerializationError, both ways."""
    assert serialization._ONE_SHOT is not None  # CPython has the C encoder
    assert _outcome(serialization.dumps_quick, value) == _outcome(serialization.dumps, value)


def _outcome(dumps: Any, value: object) -> str:
    """The text `dumps` gives, or the message of the SerializationError it raises."""
    try:
        text: str = dumps(value, "task args")
    except SerializationError as exc:
        return f"error: {exc}"
    return text


def test_a_circular_argument_raises_kombus_error() -> None:
    """The prebuilt encoder skips the circular check; the usual error is raised all the same."""
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(SerializationError, match="Circular reference detected"):
        serialization.dumps_quick(loop, "task args")
