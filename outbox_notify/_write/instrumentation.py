"""What instrumentation has wrapped around Celery's `send_task`, and how to honour it.

Tracing SDKs patch `celery.Celery.send_task` so that every message carries their headers.
The write side's template path (message_templates.py) does not call Celery's `send_task` for a
repeated shape, so it must apply the same wrapper around itself, or not be used:

- no wrapper: the template path runs as it is;
- Sentry's Celery integration (`sentry_sdk.integrations.celery`, whose wrapper starts a
  `queue.submit.celery` span and adds `sentry-trace`, `baggage` and its other headers): the
  outbox applies Sentry's own wrapper function around its send path, so Sentry does
  exactly what it does around Celery's, and Celery's unwrapped `send_task` builds the
  messages that need it;
- any other wrapper: every call takes Celery's full (wrapped) path.

Sentry's wrapper is recognised by its code object, which its wrapper factory is asked for,
so a changed Sentry release is either recognised exactly or treated as unknown.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import celery

SENTRY_MODULE = "sentry_sdk.integrations.celery"
SENTRY_FACTORY = "_wrap_task_run"


class Unknown:
    """Celery's send_task is wrapped by something the outbox cannot re-apply."""


UNKNOWN = Unknown()
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def original_send_task() -> Callable[..., Any]:
    """Celery's own `Celery.send_task`, under any wrappers."""
    unwrapped: Callable[..., Any] = inspect.unwrap(celery.Celery.send_task)
    return unwrapped


def _is_celerys(function: Any) -> bool:
    code = getattr(function, "__code__", None)
    return (
        code is not None
        and not hasattr(function, "__wrapped__")
        and getattr(function, "__qualname__", "") == "Celery.send_task"
        and code.co_filename.replace("\\", "/").endswith("celery/app/base.py")
    )


def _sentry_factory(current: Any) -> Wrapper | None:
    """Sentry's wrapper factory when `current` is what it made around Celery's send_task."""
    module = sys.modules.get(SENTRY_MODULE)
    factory = getattr(module, SENTRY_FACTORY, None)
    if factory is None or not _is_celerys(getattr(current, "__wrapped__", None)):
        return None
    try:
        probe = factory(_probe)
    except Exception:  # a Sentry release whose factory works differently: unknown
        return None
    if getattr(probe, "__code__", None) is not getattr(current, "__code__", False):
        return None
    wrapper: Wrapper = factory
    return wrapper


def _probe(*args: Any, **kwargs: Any) -> None:
    """What Sentry's factory is asked to wrap, to compare its code with the installed one."""


_seen: list[tuple[Any, Wrapper | Unknown | None]] = []


def send_task_wrapper() -> Wrapper | Unknown | None:
    """None (Celery's send_task as it ships), Sentry's wrapper factory, or UNKNOWN."""
    current = celery.Celery.send_task
    if _seen and _seen[0][0] is current:
        return _seen[0][1]
    found: Wrapper | Unknown | None
    found = None if _is_celerys(current) else _sentry_factory(current) or UNKNOWN
    _seen[:] = [(current, found)]
    return found


def known_send_task() -> bool:
    """Whether the template path can stand in for `celery.Celery.send_task` as it is now."""
    return send_task_wrapper() is not UNKNOWN
