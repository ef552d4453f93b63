"""The compact layout rebuilds any recorded message exactly: values, types and key order."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox_notify import compact, serialization
from outbox_notify.exceptions import UndecodableMessage

TASK_ID = "0b0e2f9c-3f4c-4d8e-9a57-1f1c5b0d6e21"
TASK_NAME = "tests.add"

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.sampled_from([0.0, 1.5])
    | st.text(max_size=4)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def _celery_value(name: str) -> st.SearchStrategy[Any]:
    """A header's value: often its default (of its exact type), else a scalar."""
    default = {"lang": "py", "task": TASK_NAME, "id": TASK_ID, "root_id": TASK_ID}.get(
        name, compact._CONSTANT_DEFAULTS.get(name)
    )
    return st.just(default) | scalars


@st.composite
def recorded(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Headers, publish keywords and embed as Celery's protocol 2 records them."""
    headers = {name: draw(_celery_value(name)) for name in compact.HEADER_ORDER}
    custom = draw(st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=3))
    headers.update(custom)  # a custom header of a Celery name replaces its value in place
    properties = {
        "correlation_id": draw(st.just(TASK_ID) | st.text(max_size=4)),
        "reply_to": draw(st.text(max_size=6)),
        **draw(
            st.just({"priority": None})
            | st.just({})
            | st.dictionaries(st.sampled_from(["priority", "x-p"]), values, max_size=2)
        ),
    }
    publish_kwargs = {
        "exchange": draw(st.sampled_from(["", "ex"])),
        "routing_key": draw(st.sampled_from(["celery", "other", None])),
        "serializer": draw(st.sampled_from(["json", "pickle", None])),
        "compression": draw(st.sampled_from([None, "zlib"])),
        "delivery_mode": draw(st.sampled_from([2, 1, None])),
        "declare": [],
        "headers": headers,
        "retry": True,
        **properties,
    }
    embed = draw(st.just(dict(compact.PLAIN_EMBED)) | st.dictionaries(st.text(max_size=4), values))
    return headers, publish_kwargs, embed


# A message is some thirty draws: slow to generate on a loaded machine, never wrong.
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(recorded())
def test_any_recorded_message_comes_back_exactly(message: tuple[Any, Any, Any]) -> None:
    """Decoded, the compact text gives what version 1 gives: same values, types and order."""
    headers, publish_kwargs, embed = message
    args = (publish_kwargs, headers, embed, {}, None)
    text = compact.options_text(*args, task_id=TASK_ID, task_name=TASK_NAME, app=None)
    assert text is not None
    full = serialization.decode_options(json.loads(serialization.options_text(*args)))
    small = compact.decode_options(json.loads(text), TASK_ID, TASK_NAME)
    for field in ("headers", "properties", "embed"):
        assert repr(list(getattr(small, field).items())) == repr(
            list(getattr(full, field).items())
        ), field
    for field in ("exchange", "routing_key", "serializer", "compression", "delivery_mode"):
        assert repr(getattr(small, field)) == repr(getattr(full, field)), field


def test_headers_not_in_celerys_order_keep_the_full_layout() -> None:
    """A message whose headers do not start as protocol 2's cannot be compacted: None."""
    headers = {"task": TASK_NAME, "id": TASK_ID}
    assert compact.header_overrides(headers, TASK_ID, TASK_NAME) is None


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"argsrepr": "()", "kwargsrepr": "{}", "origin": "o", "reply_to": "r", "headers": []},
        {"argsrepr": "()", "kwargsrepr": "{}", "origin": "o", "reply_to": "r", "queue": "q"},
        {"argsrepr": "()", "kwargsrepr": "{}", "origin": "o", "reply_to": "r", "queue": ["q"]},
        {"argsrepr": "()", "kwargsrepr": "{}", "origin": "o", "reply_to": "r", "queue": ["q", 1]},
        {"argsrepr": "()", "kwargsrepr": "{}", "origin": "o", "reply_to": "r", "queue": [1, "d"]},
        {"argsrepr": "()", "kwargsrepr": "{}", "origin": "o", "reply_to": "r", "embed": 3},
    ],
)
def test_malformed_compact_options_are_undecodable(bad: dict[str, Any]) -> None:
    """Broken version 4 options raise UndecodableMessage, which the relay dead-letters."""
    with pytest.raises(UndecodableMessage):
        compact.decode_options(bad, TASK_ID, TASK_NAME)


@pytest.mark.parametrize(
    ("version", "becomes"),
    [(serialization.DEFAULT_VERSION, serialization.BACKEND_CALLS_VERSION), (4, 4)],
)
def test_backend_calls_keep_a_compact_row_compact(version: int, becomes: int) -> None:
    """A chord header's calls make a version 1 row version 2; a version 4 row stays 4."""
    row = serialization.OutboxRow(
        task_id=TASK_ID,
        task_name=TASK_NAME,
        args="[]",
        kwargs="{}",
        options='{"argsrepr": "()"}',
        context="{}",
        schema_version=version,
    )
    calls = [{"call": "set_chord_size", "args": ["g", 2], "kwargs": {}, "id": "c"}]
    carried = serialization.with_backend_calls(row, calls)
    assert carried.schema_version == becomes
    assert json.loads(carried.options)["backend_calls"] == calls
