"""Makes the configured OutboxCelery the Celery app every task goes through in this process.

`@shared_task` tasks, `celery.current_app` and canvas built without an app all resolve the app
when they are called: the thread's current app, else the process's default app, else a plain
`Celery("default")` that Celery creates on the spot and that publishes straight to the broker.
A process that never imported the project's Celery module (`manage.py shell`, a management
command, a WSGI worker whose threads never did) would silently bypass the outbox that way.

So the app config, at start-up, imports OUTBOX_NOTIFY_CELERY_APP and makes it Celery's default
app (for every thread) and current app (for this one). Importing a Celery app connects to
nothing: Celery opens broker and backend connections on first use. When the setting names
something that cannot be imported or is not an OutboxCelery, tasks are refused at the call
(`RefusingCelery`) instead of going past the outbox; the system checks say why.
"""

from __future__ import annotations

import sys
from typing import Any

import celery
from celery import _state as celery_state

from outbox_notify import conf
from outbox_notify.exceptions import ConfigurationError


class RefusingCelery(celery.Celery):
    """Celery's default app while the configured app cannot be used: every send raises."""

    def __init__(self, reason: str) -> None:
        # No fix-ups (Django's would edit sys.path) and never current: it only stands in.
        super().__init__("outbox_notify_refusing", fixups=[], set_as_current=False)
        self.reason = reason

    def send_task(self, name: str, *args: Any, **kwargs: Any) -> Any:
        raise ConfigurationError(
            f"task {name!r} was not sent: {self.reason}. outbox-notify refuses to send tasks "
            "past the outbox; run `python manage.py check` for the fix"
        )


def is_outbox_app(app: Any) -> bool:
    """Whether `app` writes tasks to the outbox (an OutboxCelery instance)."""
    from outbox_notify.app import OutboxCelery

    return isinstance(app, OutboxCelery)


def current_and_default() -> tuple[Any, Any]:
    """This thread's current app and the process's default app (None when not created yet).

    Read from Celery's state without creating its fallback app, which asking
    `celery.current_app` would do.
    """
    # Both are module-level names of celery._state since Celery 3; the stubs omit them.
    tls = getattr(celery_state, "_tls")  # noqa: B009
    return tls.current_app, getattr(celery_state, "default_app")  # noqa: B009


def install() -> None:
    """Make OUTBOX_NOTIFY_CELERY_APP current and default; refuse tasks when it cannot be used."""
    try:
        path = conf.celery_app_path()
    except ConfigurationError:
        return  # outbox_notify.E004 reports it
    if path is None:
        return  # outbox_notify.E006 reports a current app that is not an OutboxCelery
    if _being_imported(path):
        # The Celery module itself set Django up (`celery -A module worker` on a module that
        # calls django.setup()): it creates the app once this returns, which makes it current
        # (and Celery's Django fix-up makes it the default). E006 reports it if not.
        return
    try:
        app = conf.celery_app()
    except ConfigurationError as exc:
        _refuse(str(exc))
        return
    except RuntimeError as exc:
        raise ConfigurationError(
            f"OUTBOX_NOTIFY_CELERY_APP={path!r} failed to import while Django was starting: "
            f"{exc}. outbox-notify imports it from its app config, so that module must not call "
            "django.setup() itself: set DJANGO_SETTINGS_MODULE with os.environ.setdefault() "
            "instead (docs/install.md, step 3)"
        ) from exc
    if not is_outbox_app(app):
        _refuse(f"OUTBOX_NOTIFY_CELERY_APP={path!r} is a {type(app).__name__}, not an OutboxCelery")
        return
    app.set_default()
    app.set_current()


def _being_imported(path: str) -> bool:
    """Whether the module of dotted `path` is in the middle of its own import."""
    module = sys.modules.get(path.rpartition(".")[0])
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _refuse(reason: str) -> None:
    """Stand a RefusingCelery in for the default app, unless an OutboxCelery already is one."""
    current, default = current_and_default()
    if is_outbox_app(default) and (current is None or is_outbox_app(current)):
        return  # tasks already go to the outbox; only the relay commands need the setting
    refusing = RefusingCelery(reason)
    refusing.set_default()
    refusing.set_current()
