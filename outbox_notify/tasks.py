"""Celery tasks outbox-notify offers to users' workers (for example from Celery beat).

Found by `app.autodiscover_tasks()` like any Django app's `tasks` module. Schedule the purge
with beat:

    app.conf.beat_schedule = {
        "outbox-notify-purge-dead-letters": {
            "task": "outbox_notify.purge_dead_letters",
            "schedule": crontab(hour=3, minute=17),
        },
        "outbox-notify-purge-inbox": {
            "task": "outbox_notify.purge_inbox",
            "schedule": crontab(hour=3, minute=47),
        },
    }

When OnceTask is the app's default task class these stay plain tasks (OnceTask leaves every
`outbox_notify.*` and `celery.*` task alone), so they still delete in many small transactions.
"""

from __future__ import annotations

from celery import shared_task

from outbox_notify import deadletter, inbox


@shared_task(name="outbox_notify.purge_dead_letters", ignore_result=True)
def purge_dead_letters(
    older_than_days: int | None = None, chunk_size: int = deadletter.CHUNK_SIZE
) -> int:
    """Delete dead letters older than N days (default: the retention setting); return how many."""
    return deadletter.purge(older_than_days, chunk_size=chunk_size).deleted


@shared_task(name="outbox_notify.purge_inbox", ignore_result=True)
def purge_inbox(older_than_days: int | None = None, chunk_size: int = inbox.CHUNK_SIZE) -> int:
    """Delete OnceTask keys older than N days (default: the retention setting); return how many."""
    return inbox.purge(older_than_days, chunk_size=chunk_size).deleted
