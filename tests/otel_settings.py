"""tests.settings, in a relay subprocess that has OpenTelemetry tracer and meter providers.

The providers are set while the settings load, as an application would in its settings or
with `opentelemetry-instrument`; the relay finds them when it is built.
"""

from __future__ import annotations

from tests.otel_support import install_from_env
from tests.settings import *  # noqa: F403

install_from_env()
