"""Where the relay reports what it did: signals, Sentry, and the helpers both share.

SignalReporter and SentryReporter are the relay's `Reporter`s for these (built in
relay/runner.py); the relay core itself imports nothing from here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
from django.dispatch import Signal

from outbox_notify import signals

if TYPE_CHECKING:
    from outbox_notify.relay.reporting import BatchReport

LOGGER_NAME = "outbox_notify"
log = structlog.get_logger(LOGGER_NAME)


class WorkerLoggerFactory:
    """structlog's default logger for every event but outbox_notify's: those go to the standard
    `logging` logger of that name, at their own level.

    In a Celery worker, structlog's default logger prints to `sys.stdout`, which the worker
    replaces with a proxy that logs every line at `worker_redirect_stdouts_level` (WARNING):
    an info event became a WARNING line. Through `logging` it keeps its level, under the
    worker's `--loglevel` and handlers.
    """

    def __init__(self) -> None:
        self.default = structlog.PrintLoggerFactory()

    def __call__(self, *args: Any) -> Any:
        if args[:1] == (LOGGER_NAME,):
            return logging.getLogger(LOGGER_NAME)
        return self.default(*args)


def route_worker_logs(**kwargs: Any) -> None:
    """Celery's `celeryd_after_setup`: send outbox_notify's events to `logging` in a worker,
    unless the project configured structlog itself (then its configuration decides)."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=WorkerLoggerFactory())


def has_receivers(signal: Signal) -> bool:
    """Whether sending would reach anyone (lets hot loops skip per-row work)."""
    return signal.has_listeners(sender=signals.SENDER)


def send_signal(signal: Signal, **kwargs: Any) -> None:
    """send_robust, logging (never raising) what a failing receiver raised."""
    if not signal.has_listeners(sender=signals.SENDER):
        return
    for receiver, response in signal.send_robust(sender=signals.SENDER, **kwargs):
        if isinstance(response, Exception):
            log.error(
                "outbox.signal_receiver_failed",
                receiver=getattr(receiver, "__qualname__", repr(receiver)),
                error=f"{type(response).__name__}: {response}",
            )


def message_sent(task_id: str, task_name: str) -> None:
    """The broker accepted a message and its row is gone (committed)."""
    send_signal(signals.outbox_message_sent, task_id=task_id, task_name=task_name)


def message_failed(task_id: str, task_name: str, retries: int) -> None:
    """A publish failed and the row was rescheduled (committed)."""
    send_signal(
        signals.outbox_message_failed, task_id=task_id, task_name=task_name, retries=retries
    )


def messages_dead_lettered(task_ids: Sequence[str], task_names: Sequence[str]) -> None:
    """Rows moved to the dead-letter table (committed)."""
    send_signal(
        signals.outbox_message_dead_lettered, task_ids=list(task_ids), task_names=list(task_names)
    )


def report_to_sentry(*, task_id: str, task_name: str, retries: int, error: str, dead: bool) -> None:
    """Tell Sentry about a row that started failing or died: once per state change."""
    try:
        import sentry_sdk
    except ImportError:
        return
    what = "dead-lettered" if dead else "publish failed"
    with sentry_sdk.new_scope() as scope:
        scope.set_tag("outbox.task_name", task_name)
        scope.set_extra("task_id", task_id)
        scope.set_extra("retries", retries)
        scope.set_extra("error", error)
        sentry_sdk.capture_message(
            f"outbox message {what}: {task_name}", level="error" if dead else "warning"
        )


class SignalReporter:
    """Sends outbox_message_sent/failed/dead_lettered for each committed batch."""

    def batch_committed(self, report: BatchReport) -> None:
        """One signal per published or failed row, one for the batch's dead letters."""
        decided = report.decided
        if has_receivers(signals.outbox_message_sent):
            for row in decided.published:
                message_sent(row.task_id, row.task_name)
        for row, retry in decided.retried:
            message_failed(row.task_id, row.task_name, retry.retries)
        if decided.dead:
            messages_dead_lettered(
                [row.task_id for row, _ in decided.dead], [row.task_name for row, _ in decided.dead]
            )


class SentryReporter:
    """Tells Sentry (when installed) about a row's first failure and about every dead letter."""

    def batch_committed(self, report: BatchReport) -> None:
        """Once per state change of a row, never per retry."""
        decided = report.decided
        for row, retry in decided.retried:
            if row.retries == 0:
                report_to_sentry(
                    task_id=row.task_id,
                    task_name=row.task_name,
                    retries=retry.retries,
                    error=retry.error,
                    dead=False,
                )
        for row, dead in decided.dead:
            report_to_sentry(
                task_id=row.task_id,
                task_name=row.task_name,
                retries=dead.retries,
                error=dead.reason,
                dead=True,
            )
