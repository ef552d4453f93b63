"""Test set-up: a real PostgreSQL (from the environment, or a private throwaway server).

- OUTBOX_TEST_DATABASE_URL (or libpq PGHOST) names a server to use; otherwise a private server
  is started from the PostgreSQL binaries with pytest-postgresql's executor and removed after.
- Redis and RabbitMQ come from OUTBOX_TEST_REDIS_URL / OUTBOX_TEST_AMQP_URL (defaults: the
  usual localhost ports). Tests that need one skip when it is down, except under CI=true,
  where they fail: CI must never pass by skipping.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from devtools import pgserver

pytest_plugins = ["pytester"]

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
AMQP_URL = os.environ.get("OUTBOX_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _external_url() -> str | None:
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if url:
        return url
    if os.environ.get("PGHOST"):
        user = os.environ.get("PGUSER", "postgres")
        password = os.environ.get("PGPASSWORD")
        auth = f"{user}:{password}" if password else user
        return f"postgresql://{auth}@{os.environ['PGHOST']}:{os.environ.get('PGPORT', '5432')}/postgres"
    return None


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """URL of the PostgreSQL server the whole session uses (the database part is ignored)."""
    url = _external_url()
    if url:
        yield url
        return
    with pgserver.running() as server:
        yield server.url()


@pytest.fixture(scope="session")
def django_db_modify_db_settings(pg_server_url: str) -> None:
    """Point every alias at the session's server, with database names unique to this run."""
    from django.conf import settings

    parts = urlsplit(pg_server_url)
    suffix = f"_{os.getpid()}"
    for alias, db in settings.DATABASES.items():
        db.update(
            HOST=parts.hostname or "127.0.0.1",
            PORT=str(parts.port or 5432),
            USER=parts.username or "postgres",
            PASSWORD=parts.password or "",
        )
        db.setdefault("TEST", {})
        db["TEST"]["NAME"] = f"test_{db['NAME']}{suffix}"
        os.environ[f"OUTBOX_TEST_DB_NAME_{alias.upper()}"] = db["TEST"]["NAME"]
    os.environ["OUTBOX_TEST_DATABASE_URL"] = pg_server_url


def _service_up(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2
        ):
            return True
    except OSError:
        return False


def require_service(name: str, url: str, default_port: int) -> None:
    """Skip (locally) or fail (under CI) when a service a test needs does not answer."""
    if _service_up(url, default_port):
        return
    message = f"{name} is not reachable at {url}"
    if IN_CI:
        pytest.fail(f"{message}; CI requires it")
    pytest.skip(message)


@pytest.fixture
def redis_url() -> str:
    """URL of a reachable Redis (the machine's, or OUTBOX_TEST_REDIS_URL)."""
    require_service("Redis", REDIS_URL, 6379)
    return REDIS_URL


@pytest.fixture
def amqp_url() -> str:
    """URL of a reachable RabbitMQ (the machine's, or OUTBOX_TEST_AMQP_URL)."""
    require_service("RabbitMQ", AMQP_URL, 5672)
    return AMQP_URL


@pytest.fixture
def queue_name() -> str:
    """A broker queue name no other test uses, so tests never share broker state."""
    return f"outbox-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def subprocess_env() -> dict[str, Any]:
    """Environment for relay/worker subprocesses: same server, this run's test database."""
    return subprocess_environment()


def subprocess_environment() -> dict[str, Any]:
    """The subprocess_env fixture's value, for fixtures of a wider scope (after django_db_setup)."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["OUTBOX_TEST_DB_NAME"] = os.environ.get("OUTBOX_TEST_DB_NAME_DEFAULT", "")
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env.get("PYTHONPATH"),
        )
        if p
    )
    return env


@pytest.fixture
def relay_env(subprocess_env: dict[str, Any], redis_url: str, queue_name: str) -> dict[str, Any]:
    """Environment for a relay subprocess publishing to Redis on this test's own queue."""
    env = dict(subprocess_env)
    env["OUTBOX_TEST_BROKER_URL"] = redis_url
    env["OUTBOX_TEST_QUEUE"] = queue_name
    return env


@pytest.fixture
def start_relay(relay_env: dict[str, Any], tmp_path: Any) -> Iterator[Any]:
    """Start `manage.py outbox_listen` subprocesses; all are stopped after the test."""
    from tests.relay_support import RelayProcess

    started: list[RelayProcess] = []

    def start(
        *args: str, command: str = "outbox_listen", env: dict[str, Any] | None = None
    ) -> RelayProcess:
        log_path = tmp_path / f"{command}-{len(started)}.log"
        relay = RelayProcess(command, list(args), env or relay_env, log_path)
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()


@pytest.fixture
def redis_queue(redis_url: str, queue_name: str) -> Iterator[Any]:
    """The Redis list this test's relays publish to; deleted after the test."""
    from tests.relay_support import RedisQueue

    queue = RedisQueue(redis_url, queue_name)
    yield queue
    queue.clear()


@pytest.fixture
def private_redis() -> Iterator[Any]:
    """A redis-server of this test's own, which the test may stop and restart."""
    import shutil

    from devtools import redisserver

    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("redis-server is not installed; CI requires it")
        pytest.skip("redis-server is not installed")
    with redisserver.running() as server:
        yield server


@pytest.fixture
def start_worker(relay_env: dict[str, Any], tmp_path: Any) -> Iterator[Any]:
    """Start a real Celery worker on the given queue; it records executions to a JSON-lines file."""
    from tests.relay_support import WorkerProcess

    started: list[WorkerProcess] = []

    def start(queue: str, env: dict[str, Any] | None = None) -> Any:
        record_file = tmp_path / f"executions-{len(started)}.jsonl"
        worker_env = dict(env or relay_env, OUTBOX_TEST_RECORD_FILE=str(record_file))
        log_path = tmp_path / f"worker-{len(started)}.log"
        started.append(WorkerProcess("tests.celery_app", queue, worker_env, log_path))
        return record_file

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def private_rabbit() -> Iterator[Any]:
    """A RabbitMQ node of this test's own, which the test may stop, freeze or alarm."""
    from devtools import rabbitserver

    if not rabbitserver.installed():
        if IN_CI:
            pytest.fail("rabbitmq-server is not installed; CI requires it")
        pytest.skip("rabbitmq-server is not installed")
    with rabbitserver.running() as node:
        yield node
