"""kombu's filesystem transport, with message files that appear complete or not at all.

kombu's own `_put` (5.7) creates the file under its final name and only then writes it, so a
worker polling the folder can take a still-empty file and die decoding it. Here the message is
written under a name the readers skip and renamed into place, which is atomic.

Selected with `CELERY_BROKER_TRANSPORT = "example.demokit.fstransport:Transport"` beside
`CELERY_BROKER_URL = "filesystem://"` (the demo's fallback when no Redis answers).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    """A filesystem channel whose writes are atomic."""

    # kombu's base channel names the argument `message`, its filesystem channel `payload`.
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Write the message beside the queue, then rename it to a name readers pick up."""
        unique = uuid.uuid4()
        # Readers match "<anything>.<queue>.msg"; ".<uuid>.partial" never matches.
        partial = os.path.join(self.data_folder_out, f".{unique}.partial")
        final = os.path.join(
            self.data_folder_out, f"{round(time.monotonic() * 1000)}_{unique}.{queue}.msg"
        )
        try:
            with open(partial, "wb") as handle:
                handle.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    """The filesystem transport with atomic message files."""

    Channel = Channel
