"""The index of ready rows that holding tasks until their ETA needs (sql/migrations/0003_held.sql).

Rows held until their ETA keep their ETA in retry_after; this partial index lets the claim
find ready rows without stepping over them. The models do not change.
"""

from __future__ import annotations

from django.db import migrations

from outbox_notify import sql


class Migration(migrations.Migration):
    dependencies = [("outbox_notify", "0002_model_defaults")]

    operations = [
        migrations.RunSQL(
            sql=sql.read("migrations/0003_held.sql"),
            reverse_sql=sql.read("migrations/0003_held.reverse.sql"),
        ),
    ]
