"""Claims that start at the relay's frontier (sql/migrations/0005_frontier.sql).

Adds the txid column the relay orders its claims on, the trigger that stamps it on UPDATE,
the indexes the claims read, and the outbox table's autovacuum settings. The column is the
database's own (its default and the trigger fill it in): the models do not change.
"""

from __future__ import annotations

from django.db import migrations

from outbox_notify import sql


class Migration(migrations.Migration):
    dependencies = [("outbox_notify", "0004_inbox")]

    operations = [
        migrations.RunSQL(
            sql=sql.read("migrations/0005_frontier.sql"),
            reverse_sql=sql.read("migrations/0005_frontier.reverse.sql"),
        ),
    ]
