"""The test suite's Celery app in a worker instrumented by opentelemetry-instrumentation-celery.

`celery -A tests.otel_worker worker --pool solo`: the task runs in this process, so tracing is
set up at import (a prefork pool would do it in `worker_process_init` instead).
"""

from __future__ import annotations

from opentelemetry.instrumentation.celery import CeleryInstrumentor

from tests.celery_app import app
from tests.otel_support import install_from_env

__all__ = ["app"]

install_from_env()
CeleryInstrumentor().instrument()
