"""Keeps each library's tables in its own database."""

from __future__ import annotations

from typing import Any

OURS = "outbox_notify"
PEER = "django_celery_outbox"


class ByLibrary:
    """outbox_notify lives on the `ours` alias; everything else on `default`."""

    def _alias(self, app_label: str) -> str:
        return "ours" if app_label == OURS else "default"

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return self._alias(model._meta.app_label)

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return self._alias(model._meta.app_label)

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == self._alias(app_label)
