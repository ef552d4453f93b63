"""The relays' samples for the admin's Outbox dashboard (sql/migrations/0006_samples.sql).

A table only the relay writes and the dashboard reads, through SQL: no model.
"""

from __future__ import annotations

from django.db import migrations

from outbox_notify import sql


class Migration(migrations.Migration):
    dependencies = [("outbox_notify", "0005_frontier")]

    operations = [
        migrations.RunSQL(
            sql=sql.read("migrations/0006_samples.sql"),
            reverse_sql=sql.read("migrations/0006_samples.reverse.sql"),
        ),
    ]
