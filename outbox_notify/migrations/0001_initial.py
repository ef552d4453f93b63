"""Schema version 1: the outbox tables and the wake-up trigger (sql/migrations/0001_initial.sql).

Released and frozen: it runs its own SQL files, never the live sql/install.sql, so a later
schema change cannot rewrite what this migration does (tests/unit/test_schema_history.py).
"""

from __future__ import annotations

from django.db import migrations, models

import outbox_notify.fields
from outbox_notify import sql


def _json() -> outbox_notify.fields.JSONTextField:
    return outbox_notify.fields.JSONTextField()


class Migration(migrations.Migration):
    initial = True

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=sql.read("migrations/0001_initial.sql"),
                    reverse_sql=sql.read("migrations/0001_initial.reverse.sql"),
                ),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="OutboxMessage",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        ("task_id", models.TextField(db_index=True)),
                        ("task_name", models.TextField()),
                        ("args", _json()),
                        ("kwargs", _json()),
                        ("options", _json()),
                        ("context", outbox_notify.fields.JSONTextField(default=dict)),
                        ("schema_version", models.SmallIntegerField()),
                        ("retries", models.IntegerField(default=0)),
                        ("retry_after", models.DateTimeField(blank=True, null=True)),
                        ("last_error", models.TextField(blank=True, null=True)),
                        ("created_at", models.DateTimeField()),
                    ],
                    options={
                        "verbose_name": "outbox message",
                        "db_table": "outbox_notify_message_v1",
                        "ordering": ("id",),
                    },
                ),
                migrations.CreateModel(
                    name="DeadLetter",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        ("task_id", models.TextField(db_index=True)),
                        ("task_name", models.TextField(db_index=True)),
                        ("args", _json()),
                        ("kwargs", _json()),
                        ("options", _json()),
                        ("context", outbox_notify.fields.JSONTextField(default=dict)),
                        ("schema_version", models.SmallIntegerField()),
                        ("retries", models.IntegerField()),
                        ("failure_reason", models.TextField()),
                        ("created_at", models.DateTimeField()),
                        ("dead_at", models.DateTimeField(db_index=True)),
                    ],
                    options={
                        "verbose_name": "dead letter",
                        "db_table": "outbox_notify_dead_letter_v1",
                        "ordering": ("-dead_at", "-id"),
                    },
                ),
            ],
        ),
    ]
