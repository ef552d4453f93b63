"""Transactional outbox for Django + Celery, relayed by PostgreSQL LISTEN/NOTIFY."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["OnceTask", "OutboxCelery", "bulk"]
__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from outbox_notify._write.batching import bulk
    from outbox_notify.app import OutboxCelery
    from outbox_notify.once import OnceTask


def __getattr__(name: str) -> Any:
    # Imported lazily so that `INSTALLED_APPS = ["outbox_notify"]` does not import Celery
    # (and the Django models it touches) before the app registry is ready.
    if name == "OutboxCelery":
        from outbox_notify.app import OutboxCelery

        return OutboxCelery
    if name == "bulk":
        from outbox_notify._write.batching import bulk

        return bulk
    if name == "OnceTask":
        from outbox_notify.once import OnceTask

        return OnceTask
    raise AttributeError(f"module 'outbox_notify' has no attribute {name!r}")
