"""The wheel alone is a working install: built, installed in a fresh venv, migrated, notifying;
with each extra alone, its relay and a Celery worker deliver a task through that extra's broker.
The sdist is the package, its SQL and docs (not the tests: see the README), and builds that wheel.

Slow (the wheel is built once; each venv is a pip install of about 10-30 s, two at a time; each
delivery starts Django five times), and deliberately part of the normal suite: these are the
only tests that see the package as users and packagers get it, without the checkout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib.metadata
import json
import re
import socket
import subprocess
import sys
import tarfile
import textwrap
import urllib.request
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu
import psycopg
import pytest
from psycopg import sql as pgsql

from devtools.process import stop_process
from outbox_notify import sql
from tests.acceptance import wheel_project
from tests.acceptance.wheel_project import clean_env
from tests.relay_support import wait_for

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
# The extra test_wheel_installs_migrates_and_notifies installs (a wheel for libpq, as in CI).
WHEEL_TEST_EXTRA = "binary"
STEP_TIMEOUT = 300.0  # seconds; each step takes a few, unless the package index is slow
NOTIFY_TIMEOUT = 10.0  # seconds; a generous deadline for one notification

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
    print(sum(len(sql.load(name)) for name in sql.QUERY_FILES))
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built once from the checkout, shared by every venv of this module."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)], cwd=out)
    (built,) = out.glob("outbox_notify-*.whl")
    return built


def _pins(folder: Path) -> Path:
    """Constraints pinning the releases this interpreter runs (the session's: oldest or newest).

    The fresh venvs then test the same releases as the rest of the session, and pip finds
    them in its cache. Only the matrix is pinned; everything else resolves as for a user.
    """
    names = [
        line.split("==")[0]
        for line in (REPO / "constraints" / "newest.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    ]
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}\n")
        except importlib.metadata.PackageNotFoundError:
            continue
    path = folder / "pins.txt"
    path.write_text("".join(pins))
    return path


def _fresh_venv(folder: Path, wheel: Path, extra: str, pins: Path) -> Path:
    """A venv holding the wheel with `extra` alone; its python.

    Made from this interpreter without pip of its own: this environment's pip installs into
    it (`pip --python`), reusing pip's cache, and nothing of the checkout or of this venv is
    on its path. Bytecode is compiled on import, for the modules the test runs only.
    """
    venv = folder / extra
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], folder, clean_env())
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    _run([*pip, "--no-compile", "-c", str(pins), f"{wheel}[{extra}]"], folder, clean_env())
    return python


def _extras_wanted(request: pytest.FixtureRequest) -> list[str]:
    """The extras the selected tests of this module install, in the order they run."""
    wanted = []
    for item in request.session.items:
        ours = getattr(item, "module", None) is request.module
        if not ours or "venv_with" not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        extra = callspec.params.get("extra") if callspec else WHEEL_TEST_EXTRA
        if extra and extra not in wanted:
            wanted.append(extra)
    return wanted


@pytest.fixture(scope="module")
def venv_with(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], Path]]:
    """venv_with(extra): the python of a fresh venv holding the wheel with that extra alone.

    Every venv the selected tests need is installed up front, two at a time, while the first
    tests run: most of an install is waiting for the disk.
    """
    folder = tmp_path_factory.mktemp("venvs")
    pins = _pins(folder)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        made = {
            extra: pool.submit(_fresh_venv, folder, wheel, extra, pins)
            for extra in _extras_wanted(request)
        }
        yield lambda extra: made[extra].result()


@pytest.fixture
def project(tmp_path: Path, pg_server_url: str, wheel_database: str) -> Path:
    """The throwaway project (tests/acceptance/wheel_project.py) on its own empty database."""
    folder = tmp_path / "project"
    wheel_project.write(folder, pg_server_url, wheel_database)
    return folder


def _project_env(project: Path) -> dict[str, str]:
    """A clean environment in which `manage.py` and `celery -A wheelproj` find the project."""
    return {**clean_env(), "DJANGO_SETTINGS_MODULE": "wheelproj.settings"}


def _assert_trigger_notifies(server_url: str, dbname: str) -> None:
    with _connect(server_url, dbname) as relay, _connect(server_url, dbname) as writer:
        relay.execute(f"LISTEN {CHANNEL}")
        relay.execute("SELECT pg_advisory_lock(%s, %s)", LOCK)  # a sleeping relay
        writer.execute(INSERT)
        received = next(relay.notifies(timeout=NOTIFY_TIMEOUT), None)
    assert received is not None, "the trigger installed from the wheel did not notify"
    assert (received.channel, received.payload) == (CHANNEL, "")


def test_wheel_installs_migrates_and_notifies(
    wheel: Path,
    venv_with: Callable[[str], Path],
    project: Path,
    pg_server_url: str,
    wheel_database: str,
) -> None:
    """The built wheel carries sql/, and in a fresh venv `migrate` installs a working trigger."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"outbox_notify/sql/{name}" for name in SQL_FILES} <= names
    assert "outbox_notify/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)  # MIT

    python = venv_with(WHEEL_TEST_EXTRA)
    env = _project_env(project)
    _run([str(python), "manage.py", "migrate", "--no-input"], cwd=project, env=env)
    _run(
        [str(python), "manage.py", "check", "--database", "default", "--fail-level", "WARNING"],
        cwd=project,
        env=env,
    )
    probed = _run([str(python), "-c", PROBE], cwd=project, env=env).split()
    module_file, tables, queries, all_queries = probed
    assert Path(module_file).is_relative_to(python.parent.parent)
    # The installed files are the checkout's: as many tables, as many named queries.
    assert tables == str(sql.read("install.sql").count("CREATE TABLE"))
    assert all_queries == str(sum(len(sql.load(name)) for name in sql.QUERY_FILES))
    assert {"claim_batch", "insert_message"} <= set(queries.split(","))

    with _connect(pg_server_url, wheel_database) as conn:
        found = conn.execute(
            "SELECT to_regclass('outbox_notify_message_v1') IS NOT NULL,"
            " to_regclass('outbox_notify_dead_letter_v1') IS NOT NULL,"
            " to_regclass('outbox_notify_inbox_v1') IS NOT NULL,"
            " to_regclass('outbox_notify_frontier_v1') IS NOT NULL,"
            " (SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'outbox_notify_wake_v1')"
        ).fetchone()
    assert found == (True, True, True, True, "O")
    # A pip install has no sql/ folder: `python -m outbox_notify.sql` prints the packaged files.
    listed = _run([str(python), "-m", "outbox_notify.sql"], cwd=python.parent, env=env).split()
    assert set(SQL_FILES) <= set(listed)
    for name in ("relay_role.sql", "migrations/0004_inbox.sql"):
        printed = _run([str(python), "-m", "outbox_notify.sql", name], cwd=python.parent, env=env)
        assert printed == (REPO / "sql" / name).read_text(), name
    _assert_trigger_notifies(pg_server_url, wheel_database)


# -- each extra alone: a relay and a worker from the venv deliver a task ---------------------

# What each extra must bring into the venv (PROBE_EXTRAS prints what is there).
EXTRA_BRINGS = {
    "binary": "psycopg_binary",
    "fast": "orjson",
    "redis": "redis",
    "sentry": "sentry_sdk",
    "datadog": "datadog",
    "otel": "opentelemetry",
    "prometheus": "prometheus_client",
}
PROBE_EXTRAS = textwrap.dedent(
    """
    import importlib.util
    import psycopg
    names = (
        "psycopg_binary",
        "orjson",
        "redis",
        "sentry_sdk",
        "datadog",
        "opentelemetry",
        "prometheus_client",
    )
    print(" ".join(name for name in names if importlib.util.find_spec(name)))
    print(psycopg.pq.__impl__)
    """
)
# Sentry's client needs a DSN to be active; nothing listens on the discard port, so what it
# would send is dropped (and never leaves the machine).
SENTRY_DSN = "http://public@127.0.0.1:9/1"
EXTRAS = [
    pytest.param("redis", marks=pytest.mark.redis),
    *(
        pytest.param(extra, marks=pytest.mark.rabbitmq)
        for extra in EXTRA_BRINGS
        if extra != "redis"
    ),
]


class Process:
    """A process started from the venv, its output in a log file; stopped by stop()."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as output:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=output, stderr=output)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then the exit status (SIGKILL after a grace period)."""
        stop_process(self.proc, timeout=30)
        return self.proc.returncode


def _executions(record_file: Path) -> list[dict[str, Any]]:
    if not record_file.exists():
        return []
    return [json.loads(line) for line in record_file.read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def _statsd_listener() -> Iterator[socket.socket]:
    """A UDP socket on a free local port, standing in for a StatsD server."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(NOTIFY_TIMEOUT)
        yield sock


def _delete_queue(broker_url: str, queue: str) -> None:
    with kombu.Connection(broker_url) as connection:
        channel: Any = connection.default_channel
        channel.queue_delete(queue)
        if not broker_url.startswith("redis"):
            channel.exchange_delete(queue)


def _extra_env(extra: str, broker_url: str, queue: str, record: Path) -> dict[str, str]:
    env = {"WHEEL_BROKER_URL": broker_url, "WHEEL_QUEUE": queue, "WHEEL_RECORD_FILE": str(record)}
    if extra == "sentry":
        env["WHEEL_SENTRY_DSN"] = SENTRY_DSN
    return env


@pytest.mark.worker
@pytest.mark.parametrize("extra", EXTRAS)
def test_each_extra_alone_relays_a_task_to_a_worker(
    extra: str, venv_with: Callable[[str], Path], project: Path, request: pytest.FixtureRequest
) -> None:
    """Installed with one extra alone, the wheel's relay and a worker deliver a task end to end
    (Redis for `redis`, RabbitMQ through py-amqp otherwise), the extra's own code path included."""
    python = venv_with(extra)
    broker_url = request.getfixturevalue("redis_url" if extra == "redis" else "amqp_url")
    queue = f"outbox-wheel-{extra}-{uuid.uuid4().hex[:8]}"
    record = project.parent / "executions.jsonl"
    env = {**_project_env(project), **_extra_env(extra, broker_url, queue, record)}
    present, pq_impl = _run([str(python), "-c", PROBE_EXTRAS], project, env).splitlines()
    assert EXTRA_BRINGS[extra] in present.split(), present
    if extra == "binary":
        assert pq_impl == "binary"
    with _statsd_listener() as statsd:
        if extra == "datadog":
            port = str(statsd.getsockname()[1])
            env |= {"WHEEL_STATSD_HOST": "127.0.0.1", "WHEEL_STATSD_PORT": port}
        check = None
        if extra == "prometheus":
            env["WHEEL_METRICS_PORT"] = str(_free_port())
            check = functools.partial(_scrape_published, int(env["WHEEL_METRICS_PORT"]))
        try:
            executed = _deliver(python, project, env, record, check)
        finally:
            _delete_queue(broker_url, queue)
        if extra == "datadog":
            assert statsd.recv(65536).startswith(b"outbox_notify."), "no metric reached StatsD"
    assert executed["marker"] == "from-the-wheel"
    if extra == "sentry":
        assert executed["sentry_trace"], "the Sentry trace did not travel with the task"


def _manage(python: Path, *argv: str) -> list[str]:
    return [str(python), "manage.py", *argv]


def _free_port() -> int:
    """A TCP port free on the loopback address a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape_published(port: int) -> None:
    """The running relay's /metrics counts a published task, and /healthz answers 200."""
    base = f"http://127.0.0.1:{port}"
    # Only http://127.0.0.1 URLs built here.
    with urllib.request.urlopen(base + "/healthz", timeout=10) as response:  # noqa: S310
        assert response.status == 200
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:  # noqa: S310
        text = response.read().decode()
    assert re.search(r"^outbox_notify_published_total\{[^}]*\} [1-9]", text, re.M), text


def _deliver(
    python: Path,
    project: Path,
    env: dict[str, str],
    record: Path,
    check: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Migrate, start a worker and a relay from the venv, enqueue one task (`delay()` in a
    transaction, from `manage.py shell`); what the worker recorded. `check` runs while the
    relay still runs, after the task ran."""
    logs = project.parent
    worker_flags = ["--pool", "solo", "--without-heartbeat", "--without-mingle", "--without-gossip"]
    worker = Process(
        [str(python.parent / "celery"), "-A", "wheelproj", "worker", "-Q", env["WHEEL_QUEUE"],
         *worker_flags, "--loglevel", "INFO"],
        project,
        env,
        logs / "worker.log",
    )  # fmt: skip
    relay: Process | None = None

    def context() -> str:
        relay_log = relay.output() if relay else ""
        return f"relay:\n{relay_log}\nworker:\n{worker.output()}"

    try:
        _run(_manage(python, "migrate", "--no-input", "-v", "0"), project, env)
        relay = Process(_manage(python, "outbox_listen"), project, env, logs / "relay.log")
        wait_for(lambda: " ready." in worker.output(), what="the worker", context=context)
        enqueued = _run(_manage(python, "shell", "-c", wheel_project.ENQUEUE), project, env)
        task_id = enqueued.strip().splitlines()[-1]
        [executed] = wait_for(
            lambda: [e for e in _executions(record) if e["id"] == task_id],
            what="the task to run on the worker",
            context=context,
        )
        if check is not None:
            check()
    finally:
        relay_status = relay.stop() if relay else None
        worker.stop()
    assert relay_status == 0, context()
    assert "Traceback" not in context(), context()
    executed_task: dict[str, Any] = executed
    return executed_task


# What the sdist holds at its top level: the package, its SQL and its docs. The tests and what
# they run on stay in the repository (the README says to run the suite from a clone).
SDIST_TOP = {
    "PKG-INFO",
    "pyproject.toml",
    ".gitignore",
    "README.md",
    "CHANGELOG.md",
    "LICENSE",
    "outbox_notify",
    "sql",
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


def _wheel_names(wheel_file: Path) -> list[str]:
    with zipfile.ZipFile(wheel_file) as archive:
        return sorted(name for name in archive.namelist() if ".dist-info/" not in name)


def test_sdist_is_the_package_and_builds_the_same_wheel(tmp_path: Path, wheel: Path) -> None:
    """The sdist holds the package, sql/ and docs/ only, says where the suite runs, and builds
    a wheel with the files of the checkout's."""
    root = _unpacked_sdist(tmp_path)
    assert {path.name for path in root.iterdir()} == SDIST_TOP
    assert not list(root.rglob("__pycache__"))
    tracked = _run(["git", "ls-files", "outbox_notify", "sql", "docs"], REPO).split()
    packed = [str(p.relative_to(root)) for p in root.glob("*/**/*") if p.is_file()]
    assert sorted(packed) == sorted(tracked)
    assert "runs from a clone of the repository" in (root / "PKG-INFO").read_text()
    out = tmp_path / "from-sdist"
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(root)], cwd=tmp_path)
    (rebuilt,) = out.glob("outbox_notify-*.whl")
    assert _wheel_names(rebuilt) == _wheel_names(wheel)
