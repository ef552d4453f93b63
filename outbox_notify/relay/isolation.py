"""Finds the message whose own send breaks the broker connection, without blaming outages.

A broker that goes away breaks the connection in the middle of whatever is being sent, so a
broken connection alone proves nothing about the message. But some messages do break it
every time (a Redis command beyond `proto-max-bulk-len`, AMQP headers larger than a frame):
left at the head of the queue, such a message would stop the relay for good. So:

- the unresolved messages of a send that broke the connection become suspects;
- later sends go out in groups: every unsuspected message first, in one group as usual, then
  the suspects, most suspicious first, in groups of halving size, so that a culprit ends up
  sent alone after the broker accepted the others;
- a message is failed (an ordinary failure that spends a retry) only when, sent alone, it
  broke the connection and had already been part of a send that broke it before.

Nothing else makes a message a suspect: a timeout, a refused connection, a blocked broker, a
connection the broker's operator closed. One break is one send: the publishers never
reconnect inside a claim, so the search goes on over the following claims.
"""

from __future__ import annotations

from collections.abc import Sequence

from outbox_notify.relay.messages import OutgoingMessage

BLAME_AFTER = 2  # breaks a message took part in, the last one sent alone


class Isolation:
    """Remembers suspects across batches and plans the groups each batch is sent in."""

    LIMIT = 10_000  # suspects remembered; beyond that they are forgotten (memory bound)

    def __init__(self) -> None:
        self.suspects: dict[int, int] = {}  # row id -> breaks it took part in

    def plan(self, messages: Sequence[OutgoingMessage]) -> list[list[int]]:
        """Indices of `messages` in the groups to send, in order (one group when none is suspect)."""
        if not self.suspects:
            return [list(range(len(messages)))]
        suspects = self.suspects
        clear = [i for i, m in enumerate(messages) if m.row.id not in suspects]
        tiers: dict[int, list[int]] = {}
        for i, message in enumerate(messages):
            if message.row.id in suspects:
                tiers.setdefault(suspects[message.row.id], []).append(i)
        groups = [clear] if clear else []
        # The most suspicious first (the group that broke last), each tier by halves: a
        # break narrows the search to one half, a success clears it.
        for count in sorted(tiers, reverse=True):
            tier = tiers[count]
            while tier:
                half = (len(tier) + 1) // 2
                groups.append(tier[:half])
                tier = tier[half:]
        return groups

    def broke(self, ids: Sequence[int]) -> bool:
        """Record a send of these rows that broke the connection; True when it proves the culprit."""
        if len(self.suspects) + len(ids) > self.LIMIT:
            self.suspects.clear()
        for row_id in ids:
            self.suspects[row_id] = self.suspects.get(row_id, 0) + 1
        # A proven culprit stays a suspect, so its retry is sent alone at once instead of
        # breaking a whole batch again.
        return len(ids) == 1 and self.suspects[ids[0]] >= BLAME_AFTER

    def cleared(self, ids: Sequence[int]) -> None:
        """Forget rows that went out (cheap: nothing to do while nobody is a suspect)."""
        if self.suspects:
            for row_id in ids:
                self.suspects.pop(row_id, None)
