"""The models declare the database's defaults (state only: the tables already have them).

`sql/install.sql` gives the columns their defaults; the models now carry the same values as
Python defaults so `objects.create()` works with only the task's own fields. Nothing runs
against the database: an AlterField here could drop the SQL defaults the relay relies on.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.utils import timezone


def _now() -> models.DateTimeField[Any, Any]:
    return models.DateTimeField(default=timezone.now)


class Migration(migrations.Migration):
    dependencies = [("outbox_notify", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField("deadletter", "created_at", _now()),
                migrations.AlterField(
                    "deadletter",
                    "dead_at",
                    models.DateTimeField(db_index=True, default=timezone.now),
                ),
                migrations.AlterField("deadletter", "retries", models.IntegerField(default=0)),
                migrations.AlterField(
                    "deadletter", "schema_version", models.SmallIntegerField(default=1)
                ),
                migrations.AlterField("outboxmessage", "created_at", _now()),
                migrations.AlterField(
                    "outboxmessage", "schema_version", models.SmallIntegerField(default=1)
                ),
            ],
        ),
    ]
