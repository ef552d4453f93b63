"""Who hears how a batch ended: a Protocol the loop calls once the outcome is committed.

The loop knows nothing of Django signals, Sentry or StatsD: runner.py builds the reporters
(outbox_notify.observability has the Django and Sentry ones) and the loop calls each in turn.
Adding one is adding a class with `batch_committed` to runner.reporters().
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Protocol

import structlog

from outbox_notify.metrics import Metrics
from outbox_notify.relay.outcome import Decided

log = structlog.get_logger("outbox_notify")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BatchReport:
    """One batch, after its outcome committed: what happened to each row, and how long it took."""

    decided: Decided
    claimed: int  # rows the batch claimed
    seconds: float  # from the claim to the commit of the outcome
    # Seconds from the oldest published row's write to this commit (None: nothing published),
    # its age at the claim on the database's clock plus the batch's own duration.
    lag: float | None


class Reporter(Protocol):
    """Hears about every committed batch. Must be cheap; may raise (Reporters logs it)."""

    def batch_committed(self, report: BatchReport) -> None: ...


class Reporters:
    """Several reporters as one: each is called in turn, and one that raises stops no other."""

    def __init__(self, reporters: Sequence[Reporter]) -> None:
        self.reporters = tuple(reporters)

    def batch_committed(self, report: BatchReport) -> None:
        """Tell every reporter; log (never raise) what one of them raised."""
        for reporter in self.reporters:
            try:
                reporter.batch_committed(report)
            except Exception as exc:  # a report must never break the relay
                log.error(
                    "outbox.reporter_failed",
                    reporter=type(reporter).__qualname__,
                    error=f"{type(exc).__name__}: {exc}",
                )


class MetricsReporter:
    """Turns batches into the relay's counters and distributions (see reference-metrics.md)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def batch_committed(self, report: BatchReport) -> None:
        """Batch size and duration, then per-task counts, deferred messages and the lag."""
        decided = report.decided
        self.metrics.batch(report.claimed, report.seconds)
        for name, count in collections.Counter(r.task_name for r in decided.published).items():
            self.metrics.published(name, count)
        for row, _ in decided.retried:
            self.metrics.failed(row.task_name)
        for row, _ in decided.dead:
            self.metrics.dead_lettered(row.task_name)
        if decided.outages:
            self.metrics.deferred(decided.outages)
        if report.lag is not None:
            self.metrics.lag(report.lag)
