"""Who hears how a batch ended: a Protocol the loop calls once the outcome is committed.

The loop knows nothing of Django signals, Sentry or StatsD: every relay logs (LogReporter)
and feeds its Metrics (MetricsReporter); runner.py adds the rest (outbox_notify.observability
has the Django signal and Sentry ones), and the loop calls each in turn. Adding one is adding
a class with `batch_committed` to runner.reporters().
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


class LogReporter:
    """The relay's log events about a committed batch (every relay has it).

    A line per batch only when asked for (`--log-batches`): a busy relay commits hundreds of
    batches a second, and the per-row warnings and errors below are what operators act on.
    """

    def __init__(self, *, per_batch: bool = False) -> None:
        self.per_batch = per_batch

    def batch_committed(self, report: BatchReport) -> None:
        """A warning per rescheduled row, an error per dead letter, an info line per batch
        with `per_batch`."""
        decided = report.decided
        for row, retry in decided.retried:
            log.warning(
                "outbox.publish_failed",
                task_id=row.task_id,
                task_name=row.task_name,
                retries=retry.retries,
                retry_in=round(retry.delay, 3),
                error=retry.error,
            )
        for row, dead in decided.dead:
            log.error(
                "outbox.dead_lettered",
                task_id=row.task_id,
                task_name=row.task_name,
                reason=dead.reason,
            )
        if not self.per_batch:
            return
        log.info(
            "outbox.batch_done",
            claimed=report.claimed,
            published=len(decided.published),
            retried=len(decided.retried),
            dead=len(decided.dead),
            deferred=decided.outages,
            skipped=decided.skipped,
            seconds=round(report.seconds, 6),
        )


@dataclasses.dataclass(kw_only=True)
class Tally:
    """Counts what committed batches did (outbox_sweep's summary line)."""

    batches: int = 0
    published: int = 0
    retried: int = 0
    dead: int = 0
    deferred: int = 0

    def batch_committed(self, report: BatchReport) -> None:
        """Add one batch's outcome to the totals."""
        decided = report.decided
        self.batches += 1
        self.published += len(decided.published)
        self.retried += len(decided.retried)
        self.dead += len(decided.dead)
        self.deferred += decided.outages

    def summary(self) -> str:
        """One line: what was published, retried, dead-lettered (and put back for an outage)."""
        line = f"published {self.published}, retried {self.retried}, dead-lettered {self.dead}"
        if self.deferred:
            line += f", left for the next run {self.deferred} (broker outage)"
        return f"{line} ({self.batches} batches)"


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


def lag(decided: Decided, seconds: float) -> float | None:
    """Seconds from the oldest published row's write to the batch's commit, on one clock.

    Its age at the claim comes from the database (created_at and now() on the same server);
    the batch's duration from the relay's monotonic clock. No wall clocks are compared.
    """
    if not decided.published:
        return None
    return max(row.age for row in decided.published) + seconds
