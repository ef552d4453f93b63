"""The chaos project's Celery app: one OnceTask that records each execution and its effect.

`chaos.record` is an `OnceTask` whose body writes one effect row (chaos_effect) in the
inbox's transaction; before that, every delivery, duplicates included, counts itself in
chaos_execution. The suite compares effects applied with commits, executions with both.

The same app serves both brokers (CHAOS_BROKER_URL: the private Redis or the private RabbitMQ
node). On RabbitMQ the scenario `rabbit_queue_limit` sends its tasks to CAPPED_QUEUE, declared
with a length limit and `x-overflow: reject-publish`; every process declares it alike.
"""

from __future__ import annotations

import os
from typing import Any

import django
from django.apps import apps

# The worker imports this module before anything sets Django up; outbox_notify's app config
# imports it while Django is setting up (apps.loading), when it must not set up again.
if not apps.ready and not apps.loading:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chaos.settings")
    django.setup()

from kombu import Exchange, Queue

from chaos.queues import CAPPED_LENGTH, CAPPED_QUEUE, DEFAULT_QUEUE
from chaos.transport import redis_options
from outbox_notify import OnceTask, OutboxCelery  # after setup: it needs the app registry

BROKER_URL = os.environ.get("CHAOS_BROKER_URL", "redis://127.0.0.1:1/0")


def _capped_queue() -> Queue:
    # Shaped as Celery shapes a queue it was not told about (a direct exchange of the same
    # name), plus the limit.
    arguments = {"x-max-length": CAPPED_LENGTH, "x-overflow": "reject-publish"}
    return Queue(
        CAPPED_QUEUE,
        Exchange(CAPPED_QUEUE, type="direct"),
        routing_key=CAPPED_QUEUE,
        queue_arguments=arguments,
    )


def _redis_options() -> dict[str, object]:
    # The visibility timeout and the lock of kombu's restore sweeps: chaos.transport.
    return redis_options() if BROKER_URL.startswith("redis") else {}


app = OutboxCelery("chaos")
app.conf.update(
    broker_url=BROKER_URL,
    task_default_queue=os.environ.get("CHAOS_QUEUE", DEFAULT_QUEUE),
    # Acknowledge after the task ran: a worker lost mid-task has its messages delivered again.
    task_acks_late=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=16,
    # Celery lowers the prefetch count after a reconnection and raises it again from the
    # pool's threads as tasks finish: a basic.qos sent from another thread than the one
    # reading the py-amqp connection, which desynchronised its frames here (a message decoded
    # from qos-ok frames and dropped: "Can't decode message body"). Off: a worker bug that is
    # not the outbox's to count.
    worker_enable_prefetch_count_reduction=False,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    broker_transport_options=_redis_options(),
    worker_hijack_root_logger=False,
    enable_utc=True,
)
# Added beside the queues Celery builds itself (not through task_queues, which would change
# how the default queue is routed): writers route to it by name, the worker consumes it.
app.amqp.queues.add(_capped_queue())


class LedgerTask(OnceTask):
    """OnceTask that counts every delivery in the execution ledger before deduplicating it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from chaos.ledger.record import record_execution, through_outages

        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        record_execution(str(request.id), str(args[0]), redelivered=redelivered)
        # A duplicate raises Ignore here (skipped, acknowledged); not a database error.
        return through_outages(lambda: OnceTask.__call__(self, *args, **kwargs))


@app.task(name="chaos.record", bind=True, base=LedgerTask)
def record(self: Any, scenario: str, seq: int) -> None:
    """The effect: one row, committed with this task id's inbox key (so once per task id)."""
    from chaos.ledger.record import apply_effect

    apply_effect(str(self.request.id), scenario)
