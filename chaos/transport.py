"""kombu's Redis transport options of the chaos worker (no Django here: tests import it).

Acknowledgements on Redis are emulated: a message a worker took sits in the `unacked` hash
until it is acknowledged, and a sweep (`restore_visible`) puts back those older than the
visibility timeout. Only one sweep runs at a time: it holds the key `unacked_mutex`, a lock
that expires after `unacked_mutex_expire` seconds (kombu's default: 300). A holder that never
releases it (a worker SIGKILLed mid-sweep, or Redis stopped between the sweep's `SET NX` and
its release, the key then saved with the data) stops every sweep until it expires, so the
unacknowledged messages of a killed worker wait that long: 5 minutes, against the 10 s of
visibility timeout below, longer than a scenario waits for its drain. The lock is kept short
here; a sweep takes milliseconds (76 ms at most in the runs measured), and two sweeps that
overlap cannot put a message back twice (each restore is a WATCH/MULTI transaction on the
hash), so a short expiry costs nothing.
"""

from __future__ import annotations

# Unacknowledged messages (a worker that lost its broker connection or was killed) come back
# after this long; short, so a run drains in seconds instead of Redis's default hour.
VISIBILITY_TIMEOUT = 10  # seconds
# How long a sweep lock left behind by a dead holder stops the sweeps (see above).
UNACKED_MUTEX_EXPIRE = 5  # seconds
RESTORE_MUTEX_KEY = "unacked_mutex"  # kombu's default name of that lock


def redis_options() -> dict[str, object]:
    """`broker_transport_options` of the chaos worker on Redis."""
    return {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_mutex_expire": UNACKED_MUTEX_EXPIRE,
        # A sweep every second (kombu 5.7's async path), not every tenth of ten seconds.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
