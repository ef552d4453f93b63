"""Django app configuration: registers the system checks and wires Celery; does no I/O."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxNotifyConfig(AppConfig):
    """The outbox_notify Django app."""

    name = "outbox_notify"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from outbox_notify import checks, wiring
        from outbox_notify._write import deferred

        checks.register()
        # Imports the configured Celery app (which connects to nothing) and makes it the app
        # every task goes through in this process, whatever imported it or not before.
        wiring.install()
        # Whether enqueued rows may wait for the COMMIT: decided now, by a probe that never
        # connects, rather than inside the first caller's transaction.
        deferred.probe_at_start_up()
