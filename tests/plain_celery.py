"""A plain celery.Celery app, for the checks that must notice one (never made current)."""

from __future__ import annotations

import celery

app = celery.Celery("plain", set_as_current=False)
