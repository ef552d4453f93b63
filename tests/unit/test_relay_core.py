"""The relay core stands alone: no Django settings, reporters behind a Protocol, one clock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import structlog

from outbox_notify.fakes import (
    FakeClock,
    FakeListener,
    InMemoryStore,
    RecordingMetrics,
    ScriptedPublisher,
    publishes_all,
)
from outbox_notify.fakes import (
    claimed_row as row,
)
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.outcome import Decided
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.reporting import BatchReport, Reporters, lag
from outbox_notify.relay.store import Outcome

ROOT = Path(__file__).resolve().parents[2]
# Modules the core must not pull in: Django's settings, database, signals and app registry,
# and this library's Django glue.
DJANGO_GLUE = (
    "django.conf",
    "django.db",
    "django.dispatch",
    "django.apps",
    "outbox_notify.conf",
    "outbox_notify.signals",
    "outbox_notify.observability",
    "outbox_notify.models",
    "outbox_notify.app",
)


def test_the_core_runs_in_a_process_without_django_settings() -> None:
    """Loop, store, listener, publishers, outcome and reporting import and run without Django.

    A child process with no DJANGO_SETTINGS_MODULE drains two rows through the loop and goes
    to sleep on fakes; the glue modules must never have been imported.
    """
    script = textwrap.dedent(
        f"""
        import sys
        import outbox_notify.relay.listener, outbox_notify.relay.store
        import outbox_notify.relay.publisher, outbox_notify.relay.redis_publisher
        import outbox_notify.relay.outcome, outbox_notify.relay.reporting
        import outbox_notify.relay.sent_events
        from outbox_notify.relay.config import RelayConfig
        from outbox_notify.relay.listener import Wake
        from outbox_notify.relay.loop import Relay
        from outbox_notify.fakes import FakeClock, FakeListener, InMemoryStore, publishes_all
        from outbox_notify.fakes import claimed_row as row

        clock = FakeClock()
        store = InMemoryStore([row(1), row(2)])
        listener = FakeListener(clock=clock, store=store, waits=[Wake.SIGNAL])
        relay = Relay(
            RelayConfig(), store=store, listener=listener, publisher=publishes_all(), clock=clock
        )
        relay.polling = False
        relay.cycle()
        assert list(store.finished[0].published) == [1, 2], store.finished
        assert listener.released == 1
        loaded = sorted(m for m in {DJANGO_GLUE!r} if m in sys.modules)
        assert not loaded, loaded
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


class Recorder:
    def __init__(self) -> None:
        self.reports: list[BatchReport] = []

    def batch_committed(self, report: BatchReport) -> None:
        self.reports.append(report)


class Broken:
    def batch_committed(self, report: BatchReport) -> None:
        raise RuntimeError("reporter bug")


def relay_with(store: InMemoryStore, publisher: ScriptedPublisher, **options: Any) -> Relay:
    return Relay(
        RelayConfig(), store=store, listener=None, publisher=publisher, clock=FakeClock(), **options
    )


def test_every_reporter_hears_each_committed_batch_even_after_one_fails() -> None:
    """A reporter that raises is logged (outbox.reporter_failed); the next still hears."""
    recorder = Recorder()
    relay = relay_with(
        InMemoryStore([row(1), row(2)]), publishes_all(), reporters=[Broken(), recorder]
    )
    with structlog.testing.capture_logs() as logs:
        relay.process_batch()
    [report] = recorder.reports
    assert [r.id for r in report.decided.published] == [1, 2]
    assert report.claimed == 2
    [failed] = [e for e in logs if e["event"] == "outbox.reporter_failed"]
    assert failed["reporter"] == "Broken"
    assert "reporter bug" in failed["error"]


def test_metrics_hear_counts_and_a_lag_on_the_database_clock() -> None:
    """Published, failed, dead and deferred counts reach Metrics, and the lag is the oldest
    row's age at the claim (database clock) plus the batch's own duration."""
    metrics = RecordingMetrics()
    answers = {1: Result.PUBLISHED, 2: Result.PUBLISHED, 3: Result.FAILED, 4: Result.OUTAGE}
    publisher = ScriptedPublisher(lambda m: Attempt(answers[m.row.id], "boom"))
    store = InMemoryStore([row(1, age=3.0), row(2, age=7.5), row(3), row(4), row(5, retries=4)])
    answers[5] = Result.FAILED  # its fifth failure: dead-lettered
    relay_with(store, publisher, metrics=metrics).process_batch()
    calls = dict(metrics.calls)
    assert ("published", ("t", 2)) in metrics.calls
    assert ("failed", ("t",)) in metrics.calls
    assert ("dead_lettered", ("t",)) in metrics.calls
    assert calls["deferred"] == (1,)
    assert calls["batch"] == (5, 0.0)  # the fake clock did not move
    assert calls["lag"] == (7.5,)


def test_lag_adds_the_batch_duration_to_the_oldest_age() -> None:
    """lag() = max age at the claim + seconds from claim to commit; None when nothing went."""
    published = Decided(
        outcome=Outcome(published=[1, 2]),
        published=[row(1, age=0.25), row(2, age=0.5)],
        retried=[],
        dead=[],
        outages=0,
        skipped=0,
    )
    assert lag(published, 0.125) == 0.625
    nothing = Decided(outcome=Outcome(), published=[], retried=[], dead=[], outages=1, skipped=0)
    assert lag(nothing, 0.125) is None


def test_reporters_run_in_the_order_given() -> None:
    """Reporters(...) calls each reporter in turn, in order."""
    heard: list[str] = []

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def batch_committed(self, report: BatchReport) -> None:
            heard.append(self.name)

    decided = Decided(outcome=Outcome(), published=[], retried=[], dead=[], outages=0, skipped=0)
    Reporters([Named("a"), Named("b")]).batch_committed(
        BatchReport(decided=decided, claimed=0, seconds=0.0, lag=None)
    )
    assert heard == ["a", "b"]


def test_listening_relay_sleeps_through_the_wake_channel_protocol() -> None:
    """A Relay takes any WakeChannel: the fake one drives a full drain-then-sleep cycle."""
    clock = FakeClock()
    store = InMemoryStore([row(1)])
    listener = FakeListener(clock=clock, store=store)
    relay = Relay(
        RelayConfig(), store=store, listener=listener, publisher=publishes_all(), clock=clock
    )
    relay.polling = False
    listener.on_statement = lambda name: relay.request_stop() if name == "peek" else None
    relay.cycle()
    assert [n for _, n in listener.statements] == ["take_lock", "peek", "release_lock"]
