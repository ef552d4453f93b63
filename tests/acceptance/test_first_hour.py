"""docs/first-hour.md, followed in a fresh project: every file it shows, every command it runs.

Needs the PostgreSQL server binaries (a private server, so `createdb proj` is exactly the
page's command), `createdb`, and `redis-server` (a private one, named through the page's
CELERY_BROKER_URL). Under CI a missing one fails the test; locally it skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools import pgserver, redisserver
from tests.acceptance import first_hour
from tests.conftest import IN_CI

ROLLBACK_GRACE = 1.0  # seconds a relay that is listening would need, many times over


def _require(binary: str) -> None:
    if shutil.which(binary) is None:
        if IN_CI:
            pytest.fail(f"{binary} is not installed; CI requires it")
        pytest.skip(f"{binary} is not installed")


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, str]]:
    """A private PostgreSQL and Redis for the page's project; the environment that finds them."""
    for binary in ("createdb", "redis-server"):
        _require(binary)
    with pgserver.running() as postgres, redisserver.running() as redis:
        yield {
            "PGHOST": postgres.host,
            "PGPORT": str(postgres.port),
            "PGUSER": postgres.user,
            "CELERY_BROKER_URL": redis.url(0),
        }


def _environment(services: dict[str, str]) -> dict[str, str]:
    """A user's shell: the repository's venv first on PATH, nothing of the test suite's."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
        and not key.startswith(("DJANGO_", "OUTBOX_", "CELERY_", "PG"))
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **services}


def _follow(page: list[first_hour.Block], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """Do what each block says; return the background processes still running."""
    background: dict[str, first_hour.Background] = {}
    try:
        for block in page:
            _do(block, cwd, env, background)
    except BaseException:
        _stop(background)
        raise
    return background


def _do(
    block: first_hour.Block,
    cwd: Path,
    env: dict[str, str],
    background: dict[str, first_hour.Background],
) -> None:
    if block.kind in {"file", "append"}:
        first_hour.write_file(block, cwd, append=block.kind == "append")
    elif block.kind == "run":
        for step in first_hour.steps(block.lines):
            printed = first_hour.run(step, cwd, env)
            assert first_hour.normalize(printed) == first_hour.normalize(step.output), step.command
            if first_hour.shell_imports(printed):  # Django 5.2's shell; 4.2's prints no such line
                assert first_hour.shell_imports(printed) == first_hour.shell_imports(step.output)
    elif block.kind == "background":
        [step] = first_hour.steps(block.lines)
        assert block.target
        background[block.target] = process = first_hour.Background(step.command, cwd, env)
        process.expect(step.output)
    elif block.kind == "more":
        assert block.target in background, f"no background process {block.target!r} yet"
        background[block.target].expect(block.lines)
    else:
        assert block.kind == "skip", f"unknown first-hour marker {block.kind!r}"


def _stop(background: dict[str, first_hour.Background]) -> None:
    for process in background.values():
        process.stop()


def test_the_first_hour_page_works_as_written(tmp_path: Path, services: dict[str, str]) -> None:
    """Every file and command of docs/first-hour.md, in a fresh directory, prints what it shows."""
    page = first_hour.blocks(first_hour.PAGE.read_text())
    kinds = [block.kind for block in page]
    assert kinds.count("file") == 3
    assert {"append", "run", "background", "more"} <= set(kinds)
    project = tmp_path / "site"
    project.mkdir()
    background = _follow(page, project, _environment(services))
    try:
        time.sleep(ROLLBACK_GRACE)
        assert "order 43" not in background["worker"].text()
    finally:
        _stop(background)


# -- the outbox cannot be bypassed: a project set up from the same page, then varied ----------


def _page_project(root: Path, services: dict[str, str], database: str) -> dict[str, str]:
    """The page's files in `root` with its own database, migrated; return the environment."""
    env = _environment(services)
    root.mkdir()
    for block in first_hour.blocks(first_hour.PAGE.read_text()):
        if block.kind in {"file", "append"}:
            continue
        if block.kind == "run" and block.lines[0].startswith("$ django-admin"):
            for step in first_hour.steps(block.lines):
                first_hour.run(step, root, env)
    for block in first_hour.blocks(first_hour.PAGE.read_text()):
        if block.kind in {"file", "append"}:
            first_hour.write_file(block, root, append=block.kind == "append")
    with (root / "proj" / "settings.py").open("a") as settings:
        settings.write(f'\nDATABASES["default"]["NAME"] = {database!r}\n')
    _manage(root, env, "createdb", database)
    _manage(root, env, "python", "manage.py", "migrate", "-v", "0")
    return env


def _manage(root: Path, env: dict[str, str], *argv: str, check: bool = True) -> str:
    result = subprocess.run(
        argv, cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


SEND_FROM_TWO_THREADS = """
import threading
from django.db import transaction
from outbox_notify.models import OutboxMessage
from shop.tasks import send_receipt

def send():
    with transaction.atomic():
        send_receipt.delay(7)

send()
thread = threading.Thread(target=send)
thread.start()
thread.join()
print("outbox rows:", OutboxMessage.objects.count())
"""


def test_without_the_package_import_tasks_still_go_through_the_outbox(
    tmp_path: Path, services: dict[str, str]
) -> None:
    """No `proj.celery` import anywhere: shell tasks, from any thread, still become outbox rows."""
    root = tmp_path / "site"
    env = _page_project(root, services, "proj_no_import")
    (root / "proj" / "__init__.py").write_text("")
    env["CELERY_BROKER_URL"] = "redis://127.0.0.1:1/0"  # a bypass would fail loudly here
    output = _manage(root, env, "python", "manage.py", "shell", "-c", SEND_FROM_TWO_THREADS)
    assert "outbox rows: 2" in output
    assert "no issues" in _manage(root, env, "python", "manage.py", "check")


def test_a_plain_celery_app_is_a_check_error_and_tasks_fail_at_the_call(
    tmp_path: Path, services: dict[str, str]
) -> None:
    """celery.Celery in place of OutboxCelery: `check` says E005, a send raises, nothing bypasses."""
    root = tmp_path / "site"
    env = _page_project(root, services, "proj_plain_app")
    celery_module = root / "proj" / "celery.py"
    celery_module.write_text(
        celery_module.read_text()
        .replace("from outbox_notify import OutboxCelery", "from celery import Celery")
        .replace('OutboxCelery("proj")', 'Celery("proj")')
    )
    checked = subprocess.run(
        ["python", "manage.py", "check"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 1
    assert "outbox_notify.E005" in checked.stderr
    output = _manage(
        root, env, "python", "manage.py", "shell", "-c",
        "from shop.tasks import send_receipt\n"
        "try:\n    send_receipt.delay(7)\nexcept Exception as exc:\n    print(type(exc).__name__, exc)",
    )  # fmt: skip
    assert "ConfigurationError task 'shop.tasks.send_receipt' was not sent" in output
