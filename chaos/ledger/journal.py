"""The relays' publish journal: every task id a relay reports published, one per line.

Connected in the relay processes (CHAOS_JOURNAL_DIR set) to outbox_message_sent, which the
relay sends once the broker accepted the message and the row's DELETE committed. A lost
message in the journal was lost after the outbox handed it over (broker or consumer side);
one missing from it never left the outbox.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_handle: Any = None


def connect() -> None:
    """Record published task ids when CHAOS_JOURNAL_DIR names a directory."""
    directory = os.environ.get("CHAOS_JOURNAL_DIR")
    if not directory:
        return
    from outbox_notify.signals import outbox_message_sent

    global _handle  # noqa: PLW0603 - one append-only file per relay process
    _handle = (Path(directory) / f"published-{os.getpid()}.txt").open("a", buffering=1)
    outbox_message_sent.connect(_record, dispatch_uid="chaos-journal")


def _record(sender: Any, task_id: str, task_name: str, **kwargs: Any) -> None:
    with _lock:
        _handle.write(task_id + "\n")


def read(directory: Path) -> set[str]:
    """Every task id any relay journaled in `directory`."""
    published: set[str] = set()
    for path in directory.glob("published-*.txt"):
        published.update(line.strip() for line in path.read_text().splitlines() if line.strip())
    return published
