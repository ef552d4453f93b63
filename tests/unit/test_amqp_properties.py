"""The RabbitMQ fast path's property writer gives exactly py-amqp's bytes, cache or not."""

from __future__ import annotations

from typing import Any

import amqp
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox_notify.relay import amqp_properties

_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
_VALUE = st.recursive(
    _SCALAR,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
# Few keys and few values, so messages repeat entries and the remembered bytes are reused.
_HEADERS = st.dictionaries(
    st.sampled_from(["id", "task", "lang", "retries", "eta", "timelimit", "x"]),
    st.sampled_from([0, 1, True, False, None, "py", [None, None], [1, True], {"a": 1}, 0.0, -0.0])
    | _VALUE,
    max_size=7,
)
_PROPERTIES = st.fixed_dictionaries(
    {"application_headers": _HEADERS},
    optional={
        "content_type": st.sampled_from(["application/json", "application/x-python-serialize"]),
        "content_encoding": st.sampled_from(["utf-8", "binary"]),
        "delivery_mode": st.sampled_from([1, 2]),
        "priority": st.integers(min_value=0, max_value=9),
        "correlation_id": st.text(max_size=36),
        "reply_to": st.text(max_size=10),
        "expiration": st.sampled_from(["1000", "600000"]),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PROPERTIES, min_size=1, max_size=6))
def test_properties_serialise_to_py_amqps_bytes(batch: list[dict[str, Any]]) -> None:
    """For any run of messages (repeated entries included) the bytes equal py-amqp's."""
    for properties in batch:
        expected = amqp.Message(b"", **properties)._serialize_properties()
        assert amqp_properties.Message(b"", **properties)._serialize_properties() == expected


def test_a_container_changed_after_writing_is_encoded_afresh() -> None:
    """The remembered value is a copy: mutating the caller's list cannot reuse stale bytes."""
    headers: dict[str, Any] = {"timelimit": [None, None]}
    amqp_properties.Message(b"", application_headers=headers)._serialize_properties()
    headers["timelimit"][0] = 30
    expected = amqp.Message(b"", application_headers=headers)._serialize_properties()
    assert (
        amqp_properties.Message(b"", application_headers=headers)._serialize_properties()
        == expected
    )
