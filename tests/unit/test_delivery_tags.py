"""The Redis fast path's delivery tags (outbox_notify/relay/redis_publisher.py, DeliveryTags);
tests/integration/test_fast_path.py checks them on envelopes in Redis."""

from __future__ import annotations

import subprocess
import sys
import uuid

from outbox_notify.relay.redis_publisher import DeliveryTags


def test_tags_are_distinct_version_4_uuids_across_several_reads() -> None:
    tags = DeliveryTags()
    drawn = [tags() for _ in range(3 * 512 + 7)]
    assert len(set(drawn)) == len(drawn)
    for tag in drawn:
        parsed = uuid.UUID(tag)
        assert (str(parsed), parsed.version, parsed.variant) == (tag, 4, uuid.RFC_4122)


# Run in an interpreter of its own: forking the test process, which may hold threads, warns
# (DeprecationWarning since Python 3.12) and pytest turns warnings into errors.
_FORK = """
import os
from outbox_notify.relay.redis_publisher import DeliveryTags

tags = DeliveryTags()
tags()  # the pool is drawn before the fork
reader, writer = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(writer, tags().encode())
    os._exit(0)
os.close(writer)
child = os.read(reader, 64).decode()
os.waitpid(pid, 0)
print(child, tags())
"""


def test_a_forked_child_draws_tags_of_its_own() -> None:
    """Tags drawn before a fork are not handed out again by both processes."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK], capture_output=True, text=True, timeout=60, check=True
    )
    child, parent = done.stdout.split()
    assert uuid.UUID(child).version == uuid.UUID(parent).version == 4
    assert child != parent
