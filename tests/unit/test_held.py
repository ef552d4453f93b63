"""The write side's hold decision and the OUTBOX_NOTIFY_HOLD_ETA_AFTER setting (no database)."""

from __future__ import annotations

import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.test import override_settings

from outbox_notify import conf, held
from outbox_notify._write import settings as write_settings
from outbox_notify.exceptions import ConfigurationError

NOW = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


def decide(eta: Any, threshold: float | None = 60.0) -> dt.datetime | None:
    """The decision for one eta header at NOW."""
    return held.hold_until({"eta": eta} if eta is not None else {}, threshold, NOW)


def test_holds_only_an_eta_further_ahead_than_the_threshold() -> None:
    """61 s ahead is held until the ETA; 60 s, 59 s, the past and no eta are not held."""
    far = NOW + dt.timedelta(seconds=61)
    assert decide(far.isoformat()) == far
    assert decide((NOW + dt.timedelta(seconds=60)).isoformat()) is None
    assert decide((NOW - dt.timedelta(hours=1)).isoformat()) is None
    assert decide(None) is None


def test_none_disables_holding_and_zero_holds_any_future_eta() -> None:
    """threshold None never holds; threshold 0 holds every ETA still ahead."""
    soon = NOW + dt.timedelta(seconds=1)
    assert decide(soon.isoformat(), None) is None
    assert decide(soon.isoformat(), 0.0) == soon


def test_a_naive_eta_is_read_as_utc_as_the_worker_reads_it_and_garbage_is_not_held() -> None:
    """A naive eta means UTC (Celery's worker: naive_as_utc); an unreadable one is not held."""
    naive = dt.datetime(2026, 11, 26, 12, 10)
    assert decide(naive.isoformat()) == naive.replace(tzinfo=dt.UTC)
    berlin = dt.datetime(2026, 11, 26, 13, 10, tzinfo=ZoneInfo("Europe/Berlin"))  # 12:10 UTC
    assert decide(berlin.isoformat()) == berlin
    assert decide("next tuesday") is None


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "60", True])
def test_invalid_settings_are_refused_naming_the_setting(value: Any) -> None:
    """Negative, non-finite and non-numeric values fail with the setting's name."""
    with override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=value):
        with pytest.raises(ConfigurationError, match="OUTBOX_NOTIFY_HOLD_ETA_AFTER"):
            conf.hold_eta_after()
        assert [name for name, _ in conf.problems()] == ["OUTBOX_NOTIFY_HOLD_ETA_AFTER"]


def test_default_and_write_settings_follow_changes() -> None:
    """The default is 60 s; the write side's cached copy follows override_settings."""
    assert conf.hold_eta_after() == conf.DEFAULT_HOLD_ETA_AFTER == 60.0
    with override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=None):
        assert write_settings.current().hold_eta_after is None
    with override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=5):
        assert write_settings.current().hold_eta_after == 5.0
