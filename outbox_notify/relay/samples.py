"""What a relay records for the admin's Outbox dashboard: one row per interval.

SampleRecorder is a Reporter: each committed batch adds to a few counters in memory (no I/O,
a handful of integer additions and at most one list append per batch). The loop asks it to
write when it samples the queue's gauges anyway; it writes at most once per SAMPLE_INTERVAL,
through the store (record_sample in sql/queries.sql), which also drops the rows older than
SAMPLES_KEPT_FOR (relay/store.py). The dashboard (outbox_notify/dashboard.py) only reads them.
"""

from __future__ import annotations

import collections
import math
import os
import socket
from typing import Protocol

from outbox_notify.relay.reporting import BatchReport
from outbox_notify.relay.store import Sample

SAMPLE_INTERVAL = 60.0  # seconds between two rows of one relay
LAGS_KEPT = 512  # per-batch lags kept per interval for the percentiles (then every 2nd, ...)
TASKS_KEPT = 20  # task names whose dead letters a row names; the rest count under "other"


class SampleSink(Protocol):
    """Where samples go: the relay's claim store (relay/store.py) or an in-memory one."""

    def record_sample(self, sample: Sample) -> None: ...


def percentile(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile of a sorted, non-empty list."""
    return ordered[max(1, math.ceil(len(ordered) * fraction)) - 1]


class SampleRecorder:
    """Counts what committed batches did since the last row, and writes the row when due."""

    def __init__(self, sink: SampleSink, *, now: float, interval: float = SAMPLE_INTERVAL) -> None:
        self.sink = sink
        self.interval = interval
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.relay = f"{self.host}/{self.pid}"
        self.reset(now)

    def reset(self, now: float) -> None:
        """Start a new interval at `now` (monotonic seconds)."""
        self.since = now
        self.published = self.retried = self.dead = self.deferred = 0
        self.dead_by_task: collections.Counter[str] = collections.Counter()
        self.lags: list[float] = []
        self.lag_stride = 1  # keep every n-th batch's lag once LAGS_KEPT filled up
        self.lag_batches = 0

    def batch_committed(self, report: BatchReport) -> None:
        """Add one batch: counts, dead letters by task, and its lag (the hot path: no I/O)."""
        decided = report.decided
        self.published += len(decided.published)
        self.deferred += decided.outages
        if decided.retried:
            self.retried += len(decided.retried)
        if decided.dead:
            self.dead += len(decided.dead)
            self.dead_by_task.update(row.task_name for row, _ in decided.dead)
        if report.lag is not None:
            self.keep_lag(report.lag)

    def keep_lag(self, lag: float) -> None:
        """Keep a bounded, evenly thinned list of the interval's per-batch lags."""
        self.lag_batches += 1
        if self.lag_batches % self.lag_stride:
            return
        self.lags.append(lag)
        if len(self.lags) >= LAGS_KEPT:
            del self.lags[::2]
            self.lag_stride *= 2

    def due(self, now: float) -> bool:
        """Whether an interval has passed since the last row (or the start)."""
        return now - self.since >= self.interval

    def sample(self, now: float, *, depth: int, polling: bool) -> Sample:
        """The row for the interval ending `now`."""
        ordered = sorted(self.lags)
        return Sample(
            relay=self.relay,
            host=self.host,
            pid=self.pid,
            mode="poll" if polling else "listen",
            seconds=now - self.since,
            published=self.published,
            retried=self.retried,
            dead_lettered=self.dead,
            deferred=self.deferred,
            lag_p50_ms=percentile(ordered, 0.5) * 1000 if ordered else None,
            lag_p99_ms=percentile(ordered, 0.99) * 1000 if ordered else None,
            depth=depth,
            dead_by_task=top_tasks(self.dead_by_task),
        )

    def write(self, now: float, *, depth: int, polling: bool) -> None:
        """Write the interval's row and start the next one; a failure keeps the counts."""
        self.sink.record_sample(self.sample(now, depth=depth, polling=polling))
        self.reset(now)


def top_tasks(counts: collections.Counter[str]) -> dict[str, int]:
    """The TASKS_KEPT task names with most dead letters, the rest summed under "other"."""
    top = dict(counts.most_common(TASKS_KEPT))
    rest = sum(counts.values()) - sum(top.values())
    if rest:
        top["other"] = top.get("other", 0) + rest
    return top
