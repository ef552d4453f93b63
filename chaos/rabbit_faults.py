"""The RabbitMQ faults, on the run's private node only (chaos.rabbit): never the shared one.

Like chaos.faults, each runs for about `duration` seconds while the writers keep writing and
returns the wall-clock window during which the broker was faulty.
"""

from __future__ import annotations

import time

from chaos.faults import Lab, Window

CLOSE_EVERY = (1.5, 3.0)  # seconds between two close_all_connections


def stop_broker(lab: Lab, duration: float) -> Window:
    """`rabbitmqctl stop` (a clean shutdown: durable queues and persistent messages survive),
    `duration` seconds down, then the node starts again with the same name and data."""
    start = time.time()
    began = time.monotonic()
    lab.node.stop()
    lab.event(f"RabbitMQ stopped in {time.monotonic() - began:.1f}s")
    time.sleep(duration)
    began = time.monotonic()
    lab.node.start()
    lab.event(f"RabbitMQ started in {time.monotonic() - began:.1f}s")
    return start, time.time()


def close_connections(lab: Lab, duration: float) -> Window:
    """`rabbitmqctl close_all_connections` every 1.5-3 s (or as often as rabbitmqctl can):
    relays and the worker alike; the first one at once."""
    start = time.time()
    end = time.monotonic() + duration
    while time.monotonic() < end:
        began = time.monotonic()
        lab.node.close_all_connections("outbox-notify chaos")
        lab.event(f"RabbitMQ closed every client connection ({time.monotonic() - began:.1f}s)")
        pause = lab.rng.uniform(*CLOSE_EVERY) - (time.monotonic() - began)
        time.sleep(max(0.0, min(pause, end - time.monotonic())))
    return start, time.time()


def memory_alarm(lab: Lab, duration: float) -> Window:
    """A memory alarm (watermark 1 byte) for `duration` s: the node blocks every publisher."""
    start = time.time()
    lab.node.memory_alarm(True)
    lab.event("RabbitMQ memory alarm raised: publishing connections blocked")
    try:
        time.sleep(duration)
    finally:
        lab.node.memory_alarm(False)
    lab.event("RabbitMQ memory alarm cleared")
    return start, time.time()


def queue_limit(lab: Lab, duration: float) -> Window:
    """The worker paused (SIGSTOP) for `duration` s, so the capped queue reaches its length
    limit and RabbitMQ refuses further publishes (`reject-publish`: a nack); then resumed."""
    worker = lab.worker
    if worker is None:
        raise RuntimeError("no worker to pause")
    start = time.time()
    worker.freeze()
    lab.event("worker paused (SIGSTOP): the capped queue fills up to its limit")
    try:
        time.sleep(duration)
    finally:
        worker.thaw()
    lab.event("worker resumed (SIGCONT)")
    return start, time.time()


def freeze_broker(lab: Lab, duration: float) -> Window:
    """SIGSTOP the node's Erlang VM (connections open, nothing answers), then SIGCONT."""
    start = time.time()
    lab.node.freeze()
    lab.event("RabbitMQ SIGSTOPped (TCP open, no replies)")
    try:
        time.sleep(duration)
    finally:
        lab.node.thaw()
    lab.event("RabbitMQ SIGCONT")
    return start, time.time()
