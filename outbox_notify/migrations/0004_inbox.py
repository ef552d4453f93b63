"""The inbox of OnceTask (sql/migrations/0004_inbox.sql): one row per committed key."""

from __future__ import annotations

from django.db import migrations, models
from django.utils import timezone

from outbox_notify import sql


class Migration(migrations.Migration):
    dependencies = [("outbox_notify", "0003_held")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=sql.read("migrations/0004_inbox.sql"),
                    reverse_sql=sql.read("migrations/0004_inbox.reverse.sql"),
                ),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="InboxRecord",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        ("scope", models.TextField()),
                        ("key", models.TextField()),
                        ("task_id", models.TextField()),
                        ("task_name", models.TextField()),
                        ("created_at", models.DateTimeField(db_index=True, default=timezone.now)),
                    ],
                    options={
                        "verbose_name": "inbox record",
                        "db_table": "outbox_notify_inbox_v1",
                        "ordering": ("-id",),
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("scope", "key"),
                                name="outbox_notify_inbox_v1_scope_key_key",
                            )
                        ],
                    },
                ),
            ],
        ),
    ]
