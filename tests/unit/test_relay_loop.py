"""The relay loop's decisions with fakes for the store, publisher, clock and metrics."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_notify.fakes import FakeClock, InMemoryStore, RecordingMetrics, ScriptedPublisher
from outbox_notify.fakes import claimed_row as row
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.store import SnapshotHolder


def relay(
    store: InMemoryStore, publisher: ScriptedPublisher, metrics: Any = None, **config: Any
) -> Relay:
    return Relay(
        RelayConfig(**config),
        store=store,
        listener=None,
        publisher=publisher,
        clock=FakeClock(),
        metrics=metrics,
    )


def test_published_rows_are_finished_as_published() -> None:
    """A successful batch finishes with every id in `published`."""
    store = InMemoryStore([row(1), row(2)])
    assert relay(store, ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED))).process_batch() == (
        2,
        False,
    )
    assert list(store.finished[0].published) == [1, 2]


def test_ordinary_failure_spends_a_retry_then_dead_letters() -> None:
    """A failing message is rescheduled with backoff until max_retries, then dead-lettered."""
    failing = ScriptedPublisher(lambda m: Attempt(Result.FAILED, "boom"))
    store = InMemoryStore([row(1, retries=0), row(2, retries=1)])
    relay(store, failing, max_retries=2, backoff_time=1.0, max_backoff=10.0).process_batch()
    [retry] = store.finished[0].retry
    [dead] = store.finished[0].dead
    assert (retry.id, retry.retries, retry.error) == (1, 1, "boom")
    assert 0.5 <= retry.delay <= 1.5
    assert (dead.id, dead.retries) == (2, 2)
    assert "publish failed 2 times; last error: boom" in dead.reason


def test_outage_spends_nothing_and_opens_the_breaker() -> None:
    """Outages leave rows untouched; the third in a row opens the breaker."""
    store = InMemoryStore([row(1)])
    r = relay(
        store,
        ScriptedPublisher(lambda m: Attempt(Result.OUTAGE, "refused")),
        broker_outage_cooldown=7.0,
    )
    for _ in range(3):
        assert r.process_batch() == (1, True)
    assert all(not o.published and not o.retry and not o.dead for o in store.finished)
    assert r.breaker.wait_time() == 7.0


def test_an_outage_never_spends_a_retry_however_often_it_repeats() -> None:
    """Only the publisher's FAILED spends retries; the same row in outage forever keeps them."""
    store = InMemoryStore([row(1)])
    r = relay(store, ScriptedPublisher(lambda m: Attempt(Result.OUTAGE, "reset")), max_retries=1)
    for _ in range(10):
        assert r.process_batch() == (1, True)
    assert all(not o.retry and not o.dead for o in store.finished)


def test_undecodable_rows_are_dead_lettered_without_publishing() -> None:
    """A row whose options are not JSON goes to the dead letters; the publisher never sees it."""
    publisher = ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED))
    store = InMemoryStore([row(1, options="{not json")])
    relay(store, publisher).process_batch()
    [dead] = store.finished[0].dead
    assert dead.reason.startswith("undecodable:")
    assert publisher.calls == 0


def test_skipped_messages_are_released_untouched() -> None:
    """Messages not attempted (deadline) appear in no list of the outcome."""
    store = InMemoryStore([row(1), row(2)])
    answers = iter([Attempt(Result.PUBLISHED), Attempt(Result.SKIPPED)])
    relay(store, ScriptedPublisher(lambda m: next(answers))).process_batch()
    assert list(store.finished[0].published) == [1]
    assert not store.finished[0].retry
    assert not store.finished[0].dead


@pytest.mark.parametrize("with_metrics", [False, True])
def test_gauges_sampled_every_interval_more_often_with_metrics(with_metrics: bool) -> None:
    """Gauges cost a query: every 15 s with metrics on, every 60 s (the dead-rows check) off."""
    metrics = RecordingMetrics() if with_metrics else None
    store = InMemoryStore([])
    store.dead_rows, store.dead_rows_held = 9, 4
    r = relay(store, ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED)), metrics=metrics)
    r.sample_gauges()
    r.sample_gauges()
    assert store.gauges == 1
    r.clock.now += Relay.GAUGE_INTERVAL  # type: ignore[attr-defined]
    r.sample_gauges()
    assert store.gauges == (2 if with_metrics else 1)
    r.clock.now += Relay.VACUUM_CHECK_INTERVAL  # type: ignore[attr-defined]
    r.sample_gauges()
    assert store.gauges == (3 if with_metrics else 2)
    if metrics is not None:
        assert ("queue", (0, 1.5)) in metrics.calls
        assert ("vacuum", (9, 0.0, 4)) in metrics.calls


def test_dead_rows_past_the_threshold_warn_with_what_holds_them_at_most_every_interval() -> None:
    """outbox.vacuum_held_back names the oldest snapshot's holder, once per interval."""
    import structlog

    holder = SnapshotHolder(kind="session", xids=12, seconds=600.0, pid=42, name="psql")
    store = InMemoryStore([])
    store.dead_rows, store.holder = Relay.DEAD_ROWS_WARNING + 5, holder
    store.dead_rows_held = Relay.DEAD_ROWS_WARNING
    r = relay(store, ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED)))
    with structlog.testing.capture_logs() as logs:
        r.sample_gauges()
        r.clock.now += Relay.VACUUM_CHECK_INTERVAL  # type: ignore[attr-defined]
        r.sample_gauges()  # sampled again, not warned again
        r.clock.now += Relay.VACUUM_WARNING_INTERVAL  # type: ignore[attr-defined]
        r.sample_gauges()
    warnings = [e for e in logs if e["event"] == "outbox.vacuum_held_back"]
    assert store.gauges == 3
    assert len(warnings) == 2
    assert warnings[0]["holder_pid"] == 42
    assert warnings[0]["dead_rows_held"] == Relay.DEAD_ROWS_WARNING
    assert (warnings[0]["dead_rows"], warnings[0]["holder"], warnings[0]["holder_name"]) == (
        Relay.DEAD_ROWS_WARNING + 5,
        "session",
        "psql",
    )
    store.dead_rows_held = Relay.DEAD_ROWS_WARNING - 1
    r.clock.now += Relay.VACUUM_WARNING_INTERVAL  # type: ignore[attr-defined]
    with structlog.testing.capture_logs() as logs:
        r.sample_gauges()
    assert not [e for e in logs if e["event"] == "outbox.vacuum_held_back"]


def test_dead_rows_only_waiting_for_autovacuum_do_not_warn() -> None:
    """A busy outbox deletes more rows than the threshold between two autovacuum rounds, and
    the relay's own claim is often the oldest snapshot: none of that is a held-back vacuum."""
    import structlog

    store = InMemoryStore([])
    store.dead_rows, store.dead_rows_held = 10 * Relay.DEAD_ROWS_WARNING, 3
    store.holder = SnapshotHolder(
        kind="session", xids=2, seconds=0.0, pid=7, name="outbox_notify.claim"
    )
    r = relay(store, ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED)))
    with structlog.testing.capture_logs() as logs:
        r.sample_gauges()
    assert store.gauges == 1
    assert not [e for e in logs if e["event"] == "outbox.vacuum_held_back"]


def test_outage_error_text_reaches_the_log() -> None:
    """The broker's error text is logged with outbox.broker_unavailable."""
    import structlog

    store = InMemoryStore([row(1)])
    r = relay(
        store, ScriptedPublisher(lambda m: Attempt(Result.OUTAGE, "ConnectionError: refused"))
    )
    with structlog.testing.capture_logs() as logs:
        r.process_batch()
    [event] = [e for e in logs if e["event"] == "outbox.broker_unavailable"]
    assert event["error"] == "ConnectionError: refused"


def test_a_gauge_error_is_logged_and_the_relay_carries_on() -> None:
    """A gauge query that fails (a permission, a timeout) is a warning, never a reconnect."""
    import structlog

    metrics = RecordingMetrics()
    store = InMemoryStore([row(1)])
    store.gauge_error = "permission denied for table outbox_notify_dead_letter_v1"
    r = relay(store, ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED)), metrics=metrics)
    with structlog.testing.capture_logs() as logs:
        r.drain()  # samples the gauges first; must not raise DatabaseUnavailable
    assert list(store.finished[0].published) == [1]
    [event] = [e for e in logs if e["event"] == "outbox.gauges_failed"]
    assert "permission denied" in event["error"]
    assert not any(name == "queue" for name, _ in metrics.calls)
    assert store.gauges == 1  # and not again before GAUGE_INTERVAL
