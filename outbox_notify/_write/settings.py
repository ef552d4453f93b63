"""The settings the write side reads on every enqueue, read once and kept until they change.

`conf` reads `django.conf.settings` on every call, which is right for the relay and the
commands; on the enqueue path the same few settings would be looked up and validated
again for every task. They are kept here instead and dropped whenever Django announces a
settings change (`override_settings` in tests, `setting_changed`), so they stay lazy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.apps import apps
from django.core.signals import setting_changed

from outbox_notify import conf
from outbox_notify.exceptions import ConfigurationError

NOT_INSTALLED = (
    "'outbox_notify' is not in INSTALLED_APPS, so no migration created the outbox tables and "
    "no relay command exists to publish the task; add it to INSTALLED_APPS, then run "
    "`python manage.py migrate`"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WriteSettings:
    """What one enqueue needs to know from the settings."""

    alias: str
    exclude_tasks: frozenset[str]
    structlog_keys: frozenset[str] | None
    hold_eta_after: float | None  # seconds; None: never hold a task in the outbox


_current: list[WriteSettings] = []


def current() -> WriteSettings:
    """The write-side settings, read on first use after start-up or a settings change.

    Raises ConfigurationError, at the enqueue, while outbox_notify is not an installed app.
    """
    if not _current:
        if apps.apps_ready and not apps.is_installed("outbox_notify"):
            raise ConfigurationError(NOT_INSTALLED)
        _current.append(
            WriteSettings(
                alias=conf.database_alias(),
                exclude_tasks=conf.exclude_tasks(),
                structlog_keys=conf.structlog_context_keys(),
                hold_eta_after=conf.hold_eta_after(),
            )
        )
    return _current[0]


def reset(**kwargs: Any) -> None:
    """Forget the settings read so far (they are read again on the next enqueue)."""
    _current.clear()


def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting.startswith(conf.PREFIX) or setting in {"DATABASES", "INSTALLED_APPS"}:
        reset()


setting_changed.connect(_on_setting_changed, dispatch_uid="outbox_notify.writeconf")
