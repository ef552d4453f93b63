"""The wheel alone is a working install: built, installed in a fresh venv, migrated, notifying.
The sdist carries what its own test suite needs: unpacked, the suite collects and runs there.

Slow (about 20 s each: a build, a venv, a pip install or a test run), and deliberately part of
the normal suite: these are the only tests that see the package as users and packagers get it,
without the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

REPO = Path(__file__).resolve().parents[2]
SQL_FILES = (
    "install.sql",
    "uninstall.sql",
    "queries.sql",
    "relay_role.sql",
    "inbox.sql",
    "migrations/0001_initial.sql",
    "migrations/0001_initial.reverse.sql",
    "migrations/0004_inbox.sql",
    "migrations/0004_inbox.reverse.sql",
)
CHANNEL = "outbox_notify_v1"
LOCK = (1869968482, 1)
INSERT = (
    "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options, schema_version)"
    " VALUES ('wheel', 't', '[]', '{}', '{}', 1)"
)
STEP_TIMEOUT = 300.0  # seconds; each step takes a few, unless the package index is slow
NOTIFY_TIMEOUT = 10.0  # seconds; a generous deadline for one notification

SETTINGS = """\
SECRET_KEY = "wheel-test"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "outbox_notify"]
OUTBOX_NOTIFY_CELERY_APP = "wheelproj_celery.app"
DATABASES = {{
    "default": {{
        "ENGINE": "django.db.backends.postgresql",
        "NAME": {name!r},
        "USER": {user!r},
        "PASSWORD": {password!r},
        "HOST": {host!r},
        "PORT": {port!r},
    }}
}}
"""

# Run in the venv after migrate: where the package and its SQL come from, and what they hold.
PROBE = textwrap.dedent(
    """
    import django
    django.setup()
    import outbox_notify
    from outbox_notify import sql
    print(outbox_notify.__file__)
    print(sql.read("install.sql").count("CREATE TABLE"))
    print(",".join(sorted(sql.queries())))
    """
)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _connect(server_url: str, dbname: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(server_url, dbname=dbname, autocommit=True)


@pytest.fixture
def wheel_database(pg_server_url: str) -> Iterator[str]:
    """An empty database for the wheel's project, dropped after the test."""
    name = f"outbox_wheel_{uuid.uuid4().hex[:12]}"
    with _connect(pg_server_url, "postgres") as admin:
        admin.execute(
            pgsql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C'").format(
                pgsql.Identifier(name)
            )
        )
    try:
        yield name
    finally:
        with _connect(pg_server_url, "postgres") as admin:
            admin.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


def _build_wheel(out: Path) -> Path:
    _run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)], cwd=out.parent
    )
    (wheel,) = out.glob("outbox_notify-*.whl")
    return wheel


def _install_into_fresh_venv(wheel: Path, venv: Path) -> Path:
    """Create a venv from this interpreter and pip install the wheel; return its python."""
    _run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent, env=_clean_env())
    python = venv / "bin" / "python"
    _run(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel), "psycopg[binary]"],
        cwd=venv.parent,
        env=_clean_env(),
    )
    return python


def _write_project(project: Path, server_url: str, dbname: str) -> None:
    parts = psycopg.conninfo.conninfo_to_dict(server_url)
    project.mkdir()
    # Every project that installs outbox_notify names its OutboxCelery (check E006 otherwise).
    (project / "wheelproj_celery.py").write_text(
        "from outbox_notify import OutboxCelery\n\napp = OutboxCelery('wheelproj')\n"
    )
    (project / "wheelproj_settings.py").write_text(
        SETTINGS.format(
            name=dbname,
            user=str(parts.get("user") or "postgres"),
            password=str(parts.get("password") or ""),
            host=str(parts.get("host") or "127.0.0.1"),
            port=str(parts.get("port") or "5432"),
        )
    )


def _clean_env() -> dict[str, str]:
    """This environment without anything that could lead Python to the checkout or its venv."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
        and not key.startswith(("DJANGO_", "OUTBOX_"))
    }


def _project_env(project: Path) -> dict[str, str]:
    """A clean environment that finds only the throwaway project's settings module."""
    return {
        **_clean_env(),
        "DJANGO_SETTINGS_MODULE": "wheelproj_settings",
        "PYTHONPATH": str(project),
    }


def _assert_trigger_notifies(server_url: str, dbname: str) -> None:
    with _connect(server_url, dbname) as relay, _connect(server_url, dbname) as writer:
        relay.execute(f"LISTEN {CHANNEL}")
        relay.execute("SELECT pg_advisory_lock(%s, %s)", LOCK)  # a sleeping relay
        writer.execute(INSERT)
        received = next(relay.notifies(timeout=NOTIFY_TIMEOUT), None)
    assert received is not None, "the trigger installed from the wheel did not notify"
    assert (received.channel, received.payload) == (CHANNEL, "")


def test_wheel_installs_migrates_and_notifies(
    tmp_path: Path, pg_server_url: str, wheel_database: str
) -> None:
    """The built wheel carries sql/, and in a fresh venv `migrate` installs a working trigger."""
    wheel = _build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"outbox_notify/sql/{name}" for name in SQL_FILES} <= names
    assert "outbox_notify/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)  # MIT

    python = _install_into_fresh_venv(wheel, tmp_path / "venv")
    _write_project(tmp_path / "project", pg_server_url, wheel_database)
    env = _project_env(tmp_path / "project")
    _run([str(python), "-m", "django", "migrate", "--no-input"], cwd=tmp_path, env=env)
    _run(
        [str(python), "-m", "django", "check", "--database", "default", "--fail-level", "WARNING"],
        cwd=tmp_path,
        env=env,
    )
    module_file, tables, queries = _run([str(python), "-c", PROBE], cwd=tmp_path, env=env).split()
    assert Path(module_file).is_relative_to(tmp_path / "venv")
    assert tables == "3"
    assert {"claim_batch", "insert_message"} <= set(queries.split(","))

    with _connect(pg_server_url, wheel_database) as conn:
        found = conn.execute(
            "SELECT to_regclass('outbox_notify_message_v1') IS NOT NULL,"
            " to_regclass('outbox_notify_dead_letter_v1') IS NOT NULL,"
            " to_regclass('outbox_notify_inbox_v1') IS NOT NULL,"
            " (SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'outbox_notify_wake_v1')"
        ).fetchone()
    assert found == (True, True, True, "O")
    # A pip install has no sql/ folder: `python -m outbox_notify.sql` prints the packaged files.
    listed = _run([str(python), "-m", "outbox_notify.sql"], cwd=python.parent, env=env).split()
    assert set(SQL_FILES) <= set(listed)
    for name in ("relay_role.sql", "migrations/0004_inbox.sql"):
        printed = _run([str(python), "-m", "outbox_notify.sql", name], cwd=python.parent, env=env)
        assert printed == (REPO / "sql" / name).read_text(), name
    _assert_trigger_notifies(pg_server_url, wheel_database)


# What the sdist holds at its top level: the package, and all that its tests import or read.
SDIST_TOP = {
    "PKG-INFO",
    "pyproject.toml",
    ".gitignore",
    "README.md",
    "CHANGELOG.md",
    "LICENSE",
    "Makefile",
    "noxfile.py",
    "constraints",
    "outbox_notify",
    "sql",
    "tests",
    "devtools",
    "example",
    "bench",
    "chaos",
    "docs",
}


def _unpacked_sdist(tmp_path: Path) -> Path:
    out = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(REPO)], cwd=tmp_path)
    (sdist,) = out.glob("outbox_notify-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    (root,) = (tmp_path / "unpacked").iterdir()
    return root


def test_sdist_carries_and_runs_its_tests(tmp_path: Path) -> None:
    """Unpacked, the sdist has every file the suite imports (all collect) and its unit tier passes."""
    root = _unpacked_sdist(tmp_path)
    assert {path.name for path in root.iterdir()} == SDIST_TOP
    assert not list(root.rglob("__pycache__"))
    for folder in ("sql", "sql/migrations", "docs", "constraints"):
        assert sorted(p.name for p in (root / folder).iterdir()) == sorted(
            p.name for p in (REPO / folder).iterdir() if p.name != "__pycache__"
        ), folder
    # Run from the unpacked tree, Python imports its copy, not the checkout this venv points at.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    where = _run(
        [sys.executable, "-c", "import outbox_notify; print(outbox_notify.__file__)"], root, env
    )
    assert Path(where.strip()).is_relative_to(root)
    collected = _run([sys.executable, "-m", "pytest", "--collect-only", "-q"], root, env)
    in_checkout = _run([sys.executable, "-m", "pytest", "--collect-only", "-q"], REPO, env)
    # "N tests collected in T s": the same N.
    assert (
        collected.splitlines()[-1].split(" in ")[0] == in_checkout.splitlines()[-1].split(" in ")[0]
    )
    # _run fails the test on pytest's exit code: a collection error or a failing test.
    unit = _run([sys.executable, "-m", "pytest", "-q", "tests/unit"], root, env)
    assert " passed" in unit.splitlines()[-1], unit
