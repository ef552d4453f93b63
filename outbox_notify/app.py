"""OutboxCelery: the write side, which stores tasks in the outbox instead of publishing them."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import celery
import structlog
from celery.result import AsyncResult
from django.db import connections, transaction

from outbox_notify import conf, context, observability, serialization, signals
from outbox_notify import sql as sql_files
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.serialization import SCHEMA_VERSION

log = structlog.get_logger("outbox_notify")

# Producer and connection arguments name a broker path we do not take.
_BROKER_ARGS = ("producer", "connection", "publisher")


class _NoConnection:
    """The `producer.connection` Celery's send_task touches; nothing here talks to a broker."""

    # Celery wraps a worker's callback publishes in a retry loop keyed on these.
    connection_errors: tuple[type[BaseException], ...] = ()
    channel_errors: tuple[type[BaseException], ...] = ()
    recoverable_connection_errors: tuple[type[BaseException], ...] = ()
    recoverable_channel_errors: tuple[type[BaseException], ...] = ()

    @contextlib.contextmanager
    def _reraise_as_library_errors(self) -> Iterator[None]:
        yield


class RecordingProducer:
    """Stands in for a kombu Producer inside Celery's send_task and records the publish."""

    def __init__(self) -> None:
        self.connection = _NoConnection()
        self.recorded: tuple[Any, dict[str, Any]] | None = None

    def revive(self, channel: Any) -> None:
        """Nothing to revive: there is no channel."""

    def publish(self, body: Any, **kwargs: Any) -> None:
        # Only the task message is kept; a `task-sent` event Celery may publish through the
        # same producer afterwards is not part of the outbox.
        if self.recorded is None:
            self.recorded = (body, kwargs)


class OutboxCelery(celery.Celery):
    """A Celery app whose send_task writes to the outbox table in the caller's transaction."""

    def _get_backend(self) -> Any:
        backend = super()._get_backend()  # type: ignore[misc]
        on_task_call = backend.on_task_call

        def skip_while_recording(producer: Any, task_id: str) -> Any:
            # Result backends (Redis) subscribe to the result when a task is sent. At enqueue
            # nothing may touch the network; AsyncResult.get() subscribes when it waits.
            if isinstance(producer, RecordingProducer):
                return None
            return on_task_call(producer, task_id)

        backend.on_task_call = skip_while_recording
        return backend

    # Celery's keyword arguments all pass through **options to Celery's own send_task.
    def send_task(  # type: ignore[override]
        self, name: str, args: Any = None, kwargs: Any = None, **options: Any
    ) -> AsyncResult[Any]:
        if name in conf.exclude_tasks():
            return super().send_task(name, args, kwargs, **options)
        for key in _BROKER_ARGS:
            options.pop(key, None)
        relative = serialization.relative_times(options)
        for key in ("countdown", "expires"):
            if key in options:
                options[key] = serialization.seconds(options[key])
        recorder = RecordingProducer()
        result = super().send_task(name, args, kwargs, producer=recorder, **options)  # type: ignore[arg-type]
        if recorder.recorded is None:
            raise ConfigurationError(f"Celery did not produce a message for task {name!r}")
        body, publish_kwargs = recorder.recorded
        row = serialization.build_row(
            body, publish_kwargs, relative=relative, context=context.capture()
        )
        write_row(row)
        return result


def write_row(row: serialization.OutboxRow) -> None:
    """Insert one row on the outbox alias, in the caller's transaction when there is one."""
    alias = conf.database_alias()
    connection = connections[alias]
    if not connection.in_atomic_block and connection.get_autocommit():
        log.warning(
            "outbox.enqueue_outside_transaction",
            task_name=row.task_name,
            task_id=row.task_id,
            database=alias,
        )
    with connection.cursor() as cursor:
        cursor.execute(
            sql_files.queries()["insert_message"],
            {
                "task_id": row.task_id,
                "task_name": row.task_name,
                "args": row.args,
                "kwargs": row.kwargs,
                "options": row.options,
                "context": row.context,
                "schema_version": SCHEMA_VERSION,
            },
        )
    if signals.outbox_message_created.has_listeners():
        transaction.on_commit(
            functools.partial(
                observability.send_signal,
                signals.outbox_message_created,
                task_id=row.task_id,
                task_name=row.task_name,
            ),
            using=alias,
        )
