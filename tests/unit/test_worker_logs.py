"""In a Celery worker, where outbox_notify's structlog events go: `logging` or the project's setup."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import pytest
import structlog
from celery import signals as celery_signals

import outbox_notify.app  # noqa: F401  # connects route_worker_logs to celeryd_after_setup

DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@pytest.fixture
def structlog_as_found() -> Iterator[None]:
    """structlog's configuration is put back as it was after the test."""
    configured = structlog.is_configured()
    config = structlog.get_config()
    structlog.reset_defaults()
    try:
        yield
    finally:
        structlog.reset_defaults()
        if configured:
            structlog.configure(**config)


@pytest.fixture
def outbox_records() -> Iterator[list[logging.LogRecord]]:
    """What reaches the standard `logging` logger `outbox_notify`."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("outbox_notify")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def worker_started() -> None:
    """What Celery sends once a worker is set up."""
    celery_signals.celeryd_after_setup.send(sender="celery@test", instance=None, conf=None)


def test_unconfigured_structlog_sends_outbox_events_to_logging_once_timed_and_levelled(
    structlog_as_found: None,
    outbox_records: list[logging.LogRecord],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An info event becomes an INFO record of `outbox_notify` without structlog's own timestamp
    and level (the worker's prefix has both); other loggers print as structlog's default does."""
    worker_started()
    structlog.get_logger("outbox_notify").info("outbox.duplicate_skipped", scope="s")
    structlog.get_logger("project").info("project.event")
    [record] = outbox_records
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "outbox.duplicate_skipped" in message
    assert "scope=s" in message
    assert "[info" not in message
    assert not DATE.search(message), message
    printed = capsys.readouterr().out
    assert "project.event" in printed
    assert DATE.search(printed), printed
    assert "[info" in printed, printed


def test_a_project_that_configured_structlog_keeps_its_setup_in_the_worker(
    structlog_as_found: None, outbox_records: list[logging.LogRecord]
) -> None:
    """structlog configured by the project before the worker starts: nothing is changed, and
    outbox_notify's events go where the project's configuration sends them."""
    out = io.StringIO()
    processors = [structlog.processors.JSONRenderer()]
    factory = structlog.PrintLoggerFactory(file=out)
    structlog.configure(processors=processors, logger_factory=factory)
    worker_started()
    assert structlog.get_config()["logger_factory"] is factory
    assert structlog.get_config()["processors"] == processors
    structlog.get_logger("outbox_notify").info("outbox.duplicate_skipped", scope="s")
    assert out.getvalue().strip() == '{"scope": "s", "event": "outbox.duplicate_skipped"}'
    assert outbox_records == []
