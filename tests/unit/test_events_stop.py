"""outbox_consume's stop: SIGTERM only sets a flag, and a pause notices it within STOP_CHECK.

The handler used to set a threading.Event, whose lock is not reentrant: a signal arriving
while the main thread held it inside Event.wait would have waited forever. That window is a
few bytecodes wide and cannot be hit on purpose, so these tests pin the replacement instead:
the handler's request takes no lock, and a pause (outage cooldown) ends on it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from outbox_notify.events.delivery import STOP_CHECK, Runner
from outbox_notify.management.commands.outbox_consume import _stop_on_signals


def _runner() -> Runner:
    consumer: Any = object()  # the runner only stores it until run()
    return Runner(consumer, outage_cooldown=30.0)


def test_sigterm_during_an_outage_pause_ends_it() -> None:
    runner = _runner()
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    with _stop_on_signals(runner):
        started = time.monotonic()
        timer.start()
        try:
            assert runner.pause(30.0) is True
        finally:
            timer.cancel()
        waited = time.monotonic() - started
    assert runner.stopping
    assert waited < 10, waited  # 30 s without the stop; a generous bound on a busy machine


def test_a_pause_without_a_stop_lasts_its_time_and_says_so() -> None:
    runner = _runner()
    started = time.monotonic()
    assert runner.pause(3 * STOP_CHECK) is False
    assert time.monotonic() - started >= 3 * STOP_CHECK
    assert not runner.stopping
