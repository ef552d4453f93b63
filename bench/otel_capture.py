"""What capturing the OpenTelemetry context adds to each enqueue (`delay()` is a hot path).

Times `outbox_notify._write.context.capture()`, the per-call context capture, in three
states: OpenTelemetry never imported (the common case, the `otel` extra absent), imported
with no span current, and inside a span (the headers are then computed and stored). The
first two should not differ from capture without the OpenTelemetry lookup (printed as
"before"). Run: `python -m bench.otel_capture` (no services needed).
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable
from typing import Any

CALLS = 200_000
REPEATS = 7


def _best(function: Callable[[], Any]) -> float:
    """Best of REPEATS runs, in nanoseconds per call."""
    return min(timeit.repeat(function, number=CALLS, repeat=REPEATS)) / CALLS * 1e9


def _before(context: Any) -> Callable[[], Any]:
    """capture() as it was before the OpenTelemetry lookup (structlog and Sentry only)."""

    def capture() -> dict[str, Any]:
        found: dict[str, Any] = {}
        values = context.structlog_context(None)
        if values:
            found["structlog"] = values
        trace = context.sentry_context()
        if trace:
            found["sentry"] = trace
        return found

    return capture


def main() -> None:
    from outbox_notify._write import context

    assert "opentelemetry.trace" not in sys.modules, "run it in a fresh interpreter"
    rows = [("before (no OpenTelemetry lookup)", _best(_before(context)), None)]
    rows.append(("OpenTelemetry not imported", *_both(context)))
    from opentelemetry.sdk.trace import TracerProvider

    rows.append(("imported, no span current", *_both(context)))
    tracer = TracerProvider().get_tracer("bench")
    with tracer.start_as_current_span("request"):
        rows.append(("inside a span (traceparent stored)", *_both(context)))
    print(f"ns per enqueue (best of {REPEATS} x {CALLS:,} calls)   capture()  otel part")
    for label, whole, part in rows:
        print(f"  {label:36} {whole:9.0f}  {'' if part is None else f'{part:9.0f}'}")


def _both(context: Any) -> tuple[float, float]:
    """capture() whole, and its OpenTelemetry part (otel_context()) alone."""
    return _best(lambda: context.capture(None)), _best(context.otel_context)


if __name__ == "__main__":
    main()
