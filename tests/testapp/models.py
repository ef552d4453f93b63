"""Tables the test tasks write to."""

from __future__ import annotations

from django.db import models


class Effect(models.Model):
    """A row a OnceTask body writes: counting these counts the effects that committed."""

    marker = models.TextField(db_index=True)
    task_id = models.TextField()
    attempt = models.IntegerField()  # request.retries of the execution that wrote it
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "testapp_effect"

    def __str__(self) -> str:
        return f"{self.marker}[{self.task_id}]"


class DeferredUnique(models.Model):
    """A unique value checked at COMMIT: lets a body fail after it returned."""

    value = models.IntegerField()

    class Meta:
        db_table = "testapp_deferred_unique"
        constraints = (
            models.UniqueConstraint(
                fields=("value",),
                name="testapp_deferred_unique_value",
                deferrable=models.Deferrable.DEFERRED,
            ),
        )

    def __str__(self) -> str:
        return str(self.value)
