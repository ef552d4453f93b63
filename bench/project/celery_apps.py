"""One Celery app per library, publishing to its own queue on the broker, and a plain one."""

from __future__ import annotations

from typing import Any

import celery
from django.conf import settings

from outbox_notify import OutboxCelery


def _configure(app: celery.Celery, queue: str) -> celery.Celery:
    app.conf.update(
        broker_url=settings.BROKER_URL,
        task_default_queue=queue,
        broker_connection_retry_on_startup=False,
        enable_utc=True,
    )
    return app


def _peer_app() -> Any:
    if not settings.PEER_ENABLED:
        return None
    from django_celery_outbox import OutboxCelery as PeerCelery

    return _configure(PeerCelery("bench_peer"), settings.PEER_QUEUE)


ours_app = _configure(OutboxCelery("bench_ours"), settings.OURS_QUEUE)
peer_app = _peer_app()
# The ceiling: Celery publishing straight to the broker, no outbox at all.
plain_app = _configure(celery.Celery("bench_plain"), settings.OURS_QUEUE)
