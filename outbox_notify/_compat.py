"""Where the fast paths may be used: the versions their equivalence tests ran on.

OnceTask's key insert sent with its transaction's BEGIN (outbox_notify/inbox.py) starts the
transaction behind psycopg's back and relies on psycopg reading the transaction status from
libpq: it is used only with the psycopg releases the suite ran on (PSYCOPG_TESTED).

Rows deferred to the caller's next statement or COMMIT (outbox_notify/_write/deferred.py) hook into
Django's private `_commit`, `_rollback` and `_close`: they are deferred only with the Django
releases the suite ran on (DJANGO_TESTED), and only once a probe has seen Django's own commit
path call the hooks. Anywhere else the rows are written at the call.

Both fast paths build each message with kombu's own code but send it through internals that
no release promises to keep (kombu's Redis channel; py-amqp's channel and connection). They
are used only with the kombu, py-amqp and redis-py releases that tests/integration/
test_fast_path.py and test_amqp_equivalence.py passed on, and only when the channel in hand
has every piece they use. Anywhere else, kombu's own Producer.publish sends every message
(and `outbox.fast_path_unavailable` says why).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

# Inclusive (major, minor) ranges whose releases the equivalence tests ran on.
KOMBU_TESTED = ((5, 3), (5, 7))
AMQP_TESTED = ((5, 1), (5, 4))
REDIS_TESTED = ((4, 5), (8, 1))
PSYCOPG_TESTED = ((3, 2), (3, 3))
DJANGO_TESTED = ((4, 2), (5, 2))

REDIS_CHANNEL_NEEDS = (
    "_q_for_pri",
    "_get_message_priority",
    "_inplace_augment_message",
    "prepare_message",
    "client",
    "_lookup",  # the bound lists of a domain event's exchange
    "deadletter_queue",
)
# Not listed, on purpose: `_next_delivery_tag`, which the Redis fast path replaces on its own
# channel with cheaper tags (relay/redis_publisher.py, DeliveryTags) only where the channel
# has it; without it, kombu's augmentation makes its own tags and nothing else changes.
AMQP_CHANNEL_NEEDS = ("send_method", "confirm_select", "events", "prepare_message")
AMQP_CONNECTION_NEEDS = ("on_blocked", "on_unblocked", "drain_events", "transport")


@functools.cache
def version_of(distribution: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[int, int]:
    parts = [*version.split("."), "0", "0"][:2]
    digits = ["".join(ch for ch in part if ch.isdigit()) or "0" for part in parts]
    return int(digits[0]), int(digits[1])


def _untested(distribution: str, tested: tuple[tuple[int, int], tuple[int, int]]) -> str | None:
    version = version_of(distribution)
    if version is None:
        return f"{distribution} is not installed"
    low, high = tested
    if not low <= _minor(version) <= high:
        return (
            f"{distribution} {version} is outside the tested "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1]}.x"
        )
    return None


def _missing(obj: Any, names: tuple[str, ...], what: str) -> str | None:
    absent = [name for name in names if not hasattr(obj, name)]
    return f"{what} lacks {', '.join(absent)}" if absent else None


@functools.cache
def psycopg_problem() -> str | None:
    """Why OnceTask may not send its key with BEGIN under this psycopg (None: it may)."""
    return _untested("psycopg", PSYCOPG_TESTED)


@functools.cache
def django_problem() -> str | None:
    """Why rows may not wait for the caller's COMMIT under this Django (None: they may)."""
    return _untested("django", DJANGO_TESTED)


def redis_problem(channel: Any) -> str | None:
    """Why the Redis fast path may not be used on this channel (None: it may)."""
    return (
        _untested("kombu", KOMBU_TESTED)
        or _untested("redis", REDIS_TESTED)
        or _missing(channel, REDIS_CHANNEL_NEEDS, "kombu's Redis channel")
    )


def amqp_problem(connection: Any, channel: Any) -> str | None:
    """Why the AMQP fast path may not be used on this connection (None: it may)."""
    return (
        _untested("kombu", KOMBU_TESTED)
        or _untested("amqp", AMQP_TESTED)
        or _missing(connection, AMQP_CONNECTION_NEEDS, "the py-amqp connection")
        or _missing(connection.transport, ("having_timeout", "sock"), "the py-amqp transport")
        or _missing(channel, AMQP_CHANNEL_NEEDS, "the py-amqp channel")
    )
