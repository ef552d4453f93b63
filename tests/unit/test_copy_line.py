"""The COPY text of a row: the unescaped shortcut equals the escaped line whenever it is taken."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from outbox_notify._write import rows
from outbox_notify.serialization import OutboxRow

tricky = st.text(alphabet=st.sampled_from("ab-\\\t\n\r'\"é"), max_size=12)


@given(task_id=tricky, task_name=tricky, arg=tricky)
def test_copy_lines_escape_what_copy_text_needs(task_id: str, task_name: str, arg: str) -> None:
    """Ids, names and JSON with tabs, newlines and backslashes give the escaped line."""
    row = OutboxRow(
        task_id=task_id or "id",
        task_name=task_name or "name",
        args=json.dumps([arg]),
        kwargs="{}",
        options=json.dumps({"k": arg}),
        context="{}",
    )
    assert rows._copy_line(row) == rows._escaped_line(row) + rows._copy_end(row)
