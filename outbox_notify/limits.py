"""The message size limit: a task too big for the broker fails at the call, not at publish.

The size is what the write side stores for the task: the bytes of its JSON texts (args,
kwargs and options, which hold the headers and embedded callbacks). That is close to what the
broker receives (the body plus headers; the Redis transport adds base64 on top), and costs
nothing to measure: the texts are already there, and kombu's JSON is ASCII, whose length in
characters is its length in bytes.
"""

from __future__ import annotations

from outbox_notify.exceptions import SerializationError

MAX_BYTES_PER_CHARACTER = 4  # UTF-8


def text_bytes(text: str | bytes) -> int:
    """The UTF-8 size of one stored text; encodes only a non-ASCII str (O(1) check)."""
    if isinstance(text, bytes) or text.isascii():
        return len(text)
    return len(text.encode("utf-8"))


def message_size(*texts: str | bytes, limit: int) -> int:
    """The stored size in bytes; skips encoding when even 4 bytes per character fits."""
    characters = sum(len(text) for text in texts)
    if characters * MAX_BYTES_PER_CHARACTER <= limit:
        return characters  # a lower bound, and certainly within the limit
    return sum(text_bytes(text) for text in texts)


def check_message_size(task_name: str, *texts: str | bytes, kind: str = "task") -> None:
    """Raise SerializationError when a task's (or an event's: `kind`) stored JSON is over
    OUTBOX_NOTIFY_MAX_MESSAGE_BYTES."""
    # Imported here: serialization (which the relay core shares) must not pull in Django.
    from outbox_notify import conf

    limit = conf.max_message_bytes()
    if limit is None:
        return
    size = message_size(*texts, limit=limit)
    if size > limit:
        raise SerializationError(
            f"{kind} {task_name!r} is {size:,} bytes as stored JSON, over the limit of "
            f"{limit:,} bytes (OUTBOX_NOTIFY_MAX_MESSAGE_BYTES); nothing was written. Pass a "
            "reference to the data (a primary key, a storage path) instead of the data itself, "
            "or raise the setting if your broker accepts larger messages."
        )
