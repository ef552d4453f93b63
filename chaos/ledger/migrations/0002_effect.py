# ruff: noqa: RUF012 - Django reads migrations' class attributes as plain lists.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("chaos_ledger", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="Effect",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task_id", models.CharField(db_index=True, max_length=64)),
                ("scenario", models.CharField(db_index=True, max_length=64)),
                ("applied_at", models.DateTimeField()),
            ],
            options={
                "db_table": "chaos_effect",
            },
        ),
    ]
