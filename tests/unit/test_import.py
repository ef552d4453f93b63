"""Importing the write side must work before Django's app registry is ready."""

from __future__ import annotations

import subprocess
import sys


def test_outbox_celery_imports_before_django_setup() -> None:
    """`from outbox_notify import OutboxCelery` in proj/celery.py runs before django.setup()."""
    code = (
        "import os; os.environ['DJANGO_SETTINGS_MODULE'] = 'tests.settings'\n"
        "from outbox_notify import OutboxCelery\n"
        "app = OutboxCelery('proj')\n"
        "import django.apps; assert not django.apps.apps.ready\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
