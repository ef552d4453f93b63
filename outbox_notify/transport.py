"""The broker URL's transport, loaded as kombu loads it (without connecting), or why it cannot be.

kombu looks the transport up when a connection object is made, long before anything
connects: Celery makes one the first time it builds a task message (for its event
dispatcher), so `delay()` meets a mistyped transport too, and the relay when it starts. What
kombu raises then (a KeyError for an unknown name, an ImportError for a missing client
library) becomes one line here, for the system check (E007), the commands and `delay()`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from outbox_notify.exceptions import ConfigurationError

SendTask = TypeVar("SendTask", bound=Callable[..., Any])

# Transports whose client library outbox-notify's `redis` extra installs.
REDIS_TRANSPORTS = frozenset({"redis", "rediss", "sentinel"})


def problem(app: Any) -> str | None:
    """Why kombu cannot load the transport of `app`'s broker URL, in one line; None if it can."""
    try:
        connection = app.connection_for_write()
        try:
            connection.transport  # noqa: B018 (instantiating it imports its client library)
        finally:
            connection.release()
    except KeyError:
        return _unknown(name(app))
    except ImportError as exc:
        return _unloadable(name(app), exc)
    return None


def require(app: Any) -> None:
    """Raise ConfigurationError, naming the app and the transport, when kombu cannot load it."""
    found = problem(app)
    if found is not None:
        raise ConfigurationError(f"Celery app {app.main!r}: {found}")


def name(app: Any) -> str:
    """The transport name kombu takes from the app's settings (never the URL's credentials)."""
    configured = app.conf.broker_transport
    if configured:
        return str(configured)
    url = str(app.conf.broker_write_url or "")
    scheme = url.partition("://")[0] if "://" in url else "amqp"
    return scheme.split("+", 1)[0]


def _unknown(transport: str) -> str:
    from kombu.transport import TRANSPORT_ALIASES

    close = difflib.get_close_matches(transport, sorted(TRANSPORT_ALIASES), n=1)
    suggestion = f"did you mean {close[0]!r}?" if close else "e.g. redis:// or amqp://"
    return f"the broker URL names transport {transport!r}, which kombu does not have: {suggestion}"


def _unloadable(transport: str, exc: ImportError) -> str:
    fix = (
        "pip install 'outbox-notify[redis]'"
        if transport in REDIS_TRANSPORTS
        else f"install the client library kombu's {transport!r} transport needs"
    )
    return f"the broker transport {transport!r} cannot be loaded ({exc}): {fix}"


def explained(send_task: SendTask) -> SendTask:
    """Wrap an app's send_task: a transport kombu cannot load raises one ConfigurationError.

    Celery looks the transport up while it builds the first task message, deep inside its
    own code, so the outbox's `delay()` meets it although it never connects to the broker.
    """

    @functools.wraps(send_task)
    def wrapper(app: Any, /, *args: Any, **kwargs: Any) -> Any:
        try:
            return send_task(app, *args, **kwargs)
        except (KeyError, ImportError):
            found = problem(app)
            if found is None:
                raise
            # Without the chain: kombu's lookup error, some forty frames down in Celery, says
            # nothing this one line does not.
            raise ConfigurationError(f"Celery app {app.main!r}: {found}") from None

    return cast(SendTask, wrapper)
