"""SIGTERM reaches the relay between two bytecodes of its main thread, wherever that thread is.

The handler may run while the thread holds a lock that is not reentrant, such as the one
structlog's PrintLogger (its default logger) writes under. The relay logged its
`outbox.relay_stopping` from the handler and so waited on its own lock forever: a relay sent
SIGTERM while it logged a batch never stopped (seen in a RabbitMQ drain; Kubernetes would have
killed it at the end of its grace period and its claim would have been published again).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import structlog

from outbox_notify.fakes import FakeClock, InMemoryStore, publishes_all
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_while_the_relay_writes_a_log_line_stops_it() -> None:
    """The signal arrives inside a log write that holds a plain Lock; the relay still stops.

    A child process installs the relay's signal routing (runner.stop_signals) and a structlog
    logger that, like PrintLogger, writes under a non-reentrant lock, and that sends the
    process SIGTERM from inside that lock: the handler runs there and then.
    """
    script = textwrap.dedent(
        """
        import os, signal, sys, threading
        import structlog
        from outbox_notify.relay.config import RelayConfig
        from outbox_notify.relay.loop import Relay
        from outbox_notify.relay.runner import stop_signals
        from outbox_notify.fakes import FakeClock, InMemoryStore, publishes_all

        lines = []
        lock = threading.Lock()

        class LockedLogger:
            def msg(self, message):
                with lock:
                    lines.append(message)
                    if "batch_committed" in message:
                        os.kill(os.getpid(), signal.SIGTERM)  # handled before the lock is left

            info = warning = error = debug = msg

        structlog.configure(
            processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
            logger_factory=lambda *args: LockedLogger(),
            cache_logger_on_first_use=False,
        )
        clock = FakeClock()
        relay = Relay(RelayConfig(), store=InMemoryStore([]), listener=None,
                      publisher=publishes_all(), clock=clock)
        holder = [relay]
        with stop_signals(holder):
            structlog.get_logger("outbox_notify").info("outbox.batch_committed")
            assert relay.stopping
        assert sum("outbox.relay_stopping" in line for line in lines) == 1, lines
        print("stopped")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"


def test_request_stop_only_records_and_the_loop_logs_it_once() -> None:
    relay = Relay(
        RelayConfig(),
        store=InMemoryStore([]),
        listener=None,
        publisher=publishes_all(),
        clock=FakeClock(),
    )
    with structlog.testing.capture_logs() as logs:
        relay.request_stop()
        relay.request_stop()
        assert logs == []
        assert relay.stopping
        assert relay.stopping
    assert [entry["event"] for entry in logs] == ["outbox.relay_stopping"]
    assert logs[0]["since_signal"] == 0  # the fake clock did not move


def test_a_stop_the_loop_never_looked_at_is_logged_before_the_relay_ends() -> None:
    """outbox_sweep's drain may end without reading `stopping` again after the signal."""
    clock = FakeClock()
    relay = Relay(
        RelayConfig(),
        store=InMemoryStore([]),
        listener=None,
        publisher=publishes_all(),
        clock=clock,
    )
    relay.request_stop()
    clock.now += 2.5
    with structlog.testing.capture_logs() as logs:
        relay.announce_stop()
        relay.announce_stop()
    assert [(e["event"], e["since_signal"]) for e in logs] == [("outbox.relay_stopping", 2.5)]
