"""The admin index's "Outbox dashboard" entry: a proxy model, so state only.

A proxy has no table and this one no permissions (default_permissions is empty): the
migration changes nothing in the database, and needs no file of sql/migrations/.
"""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("outbox_notify", "0006_samples")]

    operations = [
        # State only, said explicitly: a proxy model touches no table.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="OutboxDashboard",
                    fields=[],
                    options={
                        "verbose_name": "outbox dashboard",
                        "verbose_name_plural": "outbox dashboard",
                        "proxy": True,
                        "default_permissions": (),
                        "indexes": [],
                        "constraints": [],
                    },
                    bases=("outbox_notify.outboxmessage",),
                ),
            ],
        ),
    ]
