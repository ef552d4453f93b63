"""The relay's dashboard samples (relay/samples.py): counts per interval, bounded, one row each."""

from __future__ import annotations

import structlog

from outbox_notify.fakes import FakeClock, InMemoryStore, ScriptedPublisher
from outbox_notify.fakes import claimed_row as row
from outbox_notify.relay import samples
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.samples import SampleRecorder, percentile
from outbox_notify.relay.store import QueueGauges


def sampled_relay(store: InMemoryStore, publisher: ScriptedPublisher, **config: object) -> Relay:
    return Relay(
        RelayConfig(**config),  # type: ignore[arg-type]
        store=store,
        listener=None,
        publisher=publisher,
        clock=FakeClock(),
        samples=store,
    )


def test_a_row_per_interval_counts_what_the_batches_did() -> None:
    """Published, retried and dead-lettered rows (by task) since the last row, then zero."""
    store = InMemoryStore([row(1), row(2), row(3, retries=1, task_name="bad")])
    publisher = ScriptedPublisher(
        lambda m: Attempt(Result.PUBLISHED if m.row.id == 1 else Result.FAILED, "no")
    )
    r = sampled_relay(store, publisher, max_retries=2)
    r.process_batch()
    r.sample_gauges()
    assert store.samples == []  # not an interval yet
    r.clock.now += samples.SAMPLE_INTERVAL  # type: ignore[attr-defined]
    r.sample_gauges()
    [first] = store.samples
    assert (first["published"], first["retried"], first["dead_lettered"]) == (1, 1, 1)
    assert first["dead_by_task"] == {"bad": 1}
    assert first["mode"] == "poll"
    assert first["seconds"] == samples.SAMPLE_INTERVAL
    assert first["lag_p50_ms"] is not None
    assert first["depth"] == len(store.rows)  # the gauges read as the row was written
    r.clock.now += 1.0  # type: ignore[attr-defined]
    r.sample_gauges()
    assert len(store.samples) == 1  # at most one row per interval
    r.clock.now += samples.SAMPLE_INTERVAL  # type: ignore[attr-defined]
    r.sample_gauges()
    assert store.samples[1]["published"] == 0
    assert store.samples[1]["lag_p50_ms"] is None


def test_a_failed_write_is_logged_and_keeps_the_relay_going() -> None:
    """A missing table or privilege logs outbox.sample_failed; the next interval tries again."""
    store = InMemoryStore([])
    r = sampled_relay(store, ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED)))
    gauges = QueueGauges(depth=0, oldest_seconds=0.0, dead_rows=0, holder=None)
    store.gauge_error = "permission denied for table outbox_notify_sample_v1"
    with structlog.testing.capture_logs() as logs:
        r.record_sample(gauges, r.clock.monotonic() + samples.SAMPLE_INTERVAL)
    assert [e["event"] for e in logs] == ["outbox.sample_failed"]
    store.gauge_error = None
    r.record_sample(gauges, r.clock.monotonic() + samples.SAMPLE_INTERVAL + 1.0)
    assert len(store.samples) == 1


def test_lags_stay_bounded_and_evenly_thinned() -> None:
    """However many batches an interval has, the recorder keeps at most LAGS_KEPT lags."""
    recorder = SampleRecorder(InMemoryStore(), now=0.0)
    for n in range(100_000):
        recorder.keep_lag(float(n))
    assert len(recorder.lags) < samples.LAGS_KEPT
    ordered = sorted(recorder.lags)
    assert 45_000 < percentile(ordered, 0.5) < 55_000  # thinned evenly, not the first ones
    assert percentile(ordered, 0.99) > 97_000


def test_percentile_is_the_nearest_rank() -> None:
    """p50 of 1..4 is 2, p99 of 1..100 is 99, one value is every percentile."""
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([float(n) for n in range(1, 101)], 0.99) == 99.0
    assert percentile([7.0], 0.99) == 7.0


def test_dead_letters_name_the_top_tasks_and_sum_the_rest() -> None:
    """Past TASKS_KEPT names, the rest count under "other"."""
    import collections

    counts = collections.Counter({f"t{n}": n + 1 for n in range(samples.TASKS_KEPT + 5)})
    top = samples.top_tasks(counts)
    assert len(top) == samples.TASKS_KEPT + 1
    assert sum(top.values()) == sum(counts.values())
