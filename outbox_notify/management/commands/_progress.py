"""A progress line for long commands: redrawn in place on a terminal's stderr, absent elsewhere.

Cron, pipes and log collectors get nothing (stderr is not a TTY there), so their output stays
what it was; stdout, which carries the command's report, is never touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

REDRAW_EVERY = 0.2  # seconds between two redraws of the line
BAR_WIDTH = 24  # characters of the bar, when the total is known
_CLEAR = "\r\x1b[K"  # back to the line's start, erase it


class Progress:
    """`label: done[/total]` with a bar and a rate, on `stream` when it is a terminal."""

    def __init__(
        self,
        stream: Any,
        label: str,
        *,
        total: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self.clock = clock
        self.enabled = bool(getattr(stream, "isatty", lambda: False)())
        self.started = clock()
        self.drawn_at: float | None = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, done: int) -> None:
        """Show `done` (the first call at once, then at most every REDRAW_EVERY seconds)."""
        if not self.enabled:
            return
        now = self.clock()
        if self.drawn_at is not None and now - self.drawn_at < REDRAW_EVERY:
            return
        self.drawn_at = now
        self._write(_CLEAR + self.line(done, now - self.started))

    def line(self, done: int, elapsed: float) -> str:
        """The text of the line for `done` rows after `elapsed` seconds."""
        rate = f"{done / elapsed:,.0f}/s" if elapsed > 0 else ""
        if not self.total:
            return f"{self.label}: {done:,} {rate}".rstrip()
        share = min(done / self.total, 1.0)
        filled = round(share * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return f"{self.label}: [{bar}] {done:,}/{self.total:,} {share:.0%} {rate}".rstrip()

    def close(self) -> None:
        """Erase the line (the report that follows says how it ended)."""
        if self.enabled and self.drawn_at is not None:
            self._write(_CLEAR)

    def _write(self, text: str) -> None:
        self.stream.write(text, ending="")
        self.stream.flush()
