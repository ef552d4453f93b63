"""The template path's own stand-ins for Celery's functions: saferepr, and uuid() for task ids."""

from __future__ import annotations

import uuid
from typing import Any

from celery.utils.saferepr import saferepr
from hypothesis import given
from hypothesis import strategies as st

from outbox_notify._write.message_templates import argsrepr, new_task_id

scalars = st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=40))
flat = st.one_of(
    st.tuples(scalars),
    st.lists(scalars, max_size=8).map(tuple),
    st.lists(scalars, max_size=8),
    st.dictionaries(st.one_of(st.text(max_size=10), st.integers()), scalars, max_size=6),
)
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=12
)


@given(flat, st.sampled_from([8, 40, 1024]), st.sampled_from([1, 3]))
def test_flat_values_match_saferepr(value: Any, maxlen: int, maxlevels: int) -> None:
    """Flat containers of scalars give saferepr's text, truncated or not."""
    assert argsrepr(value, maxlen, maxlevels) == saferepr(value, maxlen, maxlevels=maxlevels)


@given(anything, st.sampled_from([0, 1, 3]))
def test_nested_values_fall_back_to_saferepr(value: Any, maxlevels: int) -> None:
    """Anything nested or odd is saferepr's own output."""
    assert argsrepr(value, 1024, maxlevels) == saferepr(value, 1024, maxlevels=maxlevels)


def test_new_task_ids_are_uuid4_texts_like_celerys() -> None:
    """A generated task id is a random UUID4 in canonical text, as kombu's uuid() gives."""
    ids = [new_task_id() for _ in range(2_000)]
    for task_id in ids:
        parsed = uuid.UUID(task_id)
        assert str(parsed) == task_id
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
    assert len(set(ids)) == len(ids)
    assert {task_id[19] for task_id in ids} == set("89ab")  # every variant nibble occurs
