"""AppConfig of the chaos ledger."""

from __future__ import annotations

from django.apps import AppConfig


class LedgerConfig(AppConfig):
    """Tables the chaos run counts with."""

    name = "chaos.ledger"
    label = "chaos_ledger"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from chaos.ledger import journal

        journal.connect()
