"""What the dashboard's samples cost the relay's hot path: SampleRecorder.batch_committed per
batch, against the MetricsReporter every relay already runs, both fed the same batches.

Run: .venv/bin/python -m bench.sample_cost   (no database, no broker; prints ns per batch)
"""

from __future__ import annotations

import time

from outbox_notify.fakes import InMemoryStore, RecordingMetrics, claimed_row
from outbox_notify.relay.outcome import Decided
from outbox_notify.relay.reporting import BatchReport, MetricsReporter
from outbox_notify.relay.samples import SampleRecorder
from outbox_notify.relay.store import Dead, Outcome

BATCHES = 200_000
BATCH_SIZE = 100  # rows published per batch, the relay's default batch size


def report(*, dead: bool) -> BatchReport:
    rows = [claimed_row(n) for n in range(BATCH_SIZE)]
    dead_rows = [(claimed_row(-1, task_name="bad"), Dead(id=-1, retries=5, reason="r"))]
    decided = Decided(
        outcome=Outcome(published=[r.id for r in rows]),
        published=rows,
        retried=[],
        dead=dead_rows if dead else [],
        outages=0,
        skipped=0,
    )
    return BatchReport(decided=decided, claimed=BATCH_SIZE, seconds=0.01, lag=0.05)


def per_batch_ns(reporter: object, batch: BatchReport) -> float:
    call = reporter.batch_committed  # type: ignore[attr-defined]
    started = time.perf_counter_ns()
    for _ in range(BATCHES):
        call(batch)
    return (time.perf_counter_ns() - started) / BATCHES


def main() -> None:
    for dead in (False, True):
        batch = report(dead=dead)
        sampler = per_batch_ns(SampleRecorder(InMemoryStore(), now=0.0), batch)
        metrics = per_batch_ns(MetricsReporter(RecordingMetrics()), batch)
        label = "with a dead letter" if dead else "all published"
        print(
            f"batch of {BATCH_SIZE} ({label}): SampleRecorder {sampler:.0f} ns/batch "
            f"({sampler / BATCH_SIZE:.1f} ns/message); MetricsReporter {metrics:.0f} ns/batch"
        )


if __name__ == "__main__":
    main()
