"""The admin's Outbox dashboard in a real headless Chromium (Debian's, driven by Selenium):
charts drawn from samples the relay's own store wrote, the relays, the held ETAs, the links."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection

from outbox_notify.relay.runner import connection_kwargs
from outbox_notify.relay.samples import SampleRecorder
from outbox_notify.relay.store import ClaimStore
from tests.conftest import IN_CI

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the live server and the relay's store see only committed rows.

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# Where to keep the screenshot besides the test's own directory (docs/img/dashboard.png when
# the docs' picture is retaken).
SCREENSHOT = os.environ.get("OUTBOX_DASHBOARD_SCREENSHOT")
PASSWORD = "dashboard-pw"
LOAD_TIMEOUT = 60  # seconds: a page load on a loaded 2-core machine
HELD = (
    "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
    " schema_version, retry_after)"
    " SELECT 'h-' || n, 'tests.remind', '[]', '{}', '{}', 1, now() + n * interval '7 minutes'"
    " FROM generate_series(1, 6) AS n"
)


def browser_or_skip() -> Any:
    """A headless Chromium; skipped locally, failed under CI, when it is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        missing = f"selenium is not installed ({exc})"
    else:
        if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
            options = webdriver.ChromeOptions()
            options.binary_location = CHROMIUM
            for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
                options.add_argument(flag)
            options.add_argument("--window-size=1300,1900")
            return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        missing = "chromium or chromedriver is missing (devtools/system-packages.sh installs them)"
    if IN_CI:
        pytest.fail(f"{missing}; CI requires it")
    pytest.skip(missing)


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = browser_or_skip()
    yield driver
    driver.quit()


def clear_samples() -> None:
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM outbox_notify_sample_v1")


@pytest.fixture
def samples() -> Iterator[None]:
    """An hour of one relay's samples, written by the relay's store, then spread in time."""
    clear_samples()
    store = ClaimStore(connection_kwargs("default"), stale_timeout=30.0)
    store.connect()
    recorder = SampleRecorder(store, now=0.0)
    for minute in range(60):
        recorder.published = 600 + 20 * minute
        recorder.retried = minute % 7
        recorder.keep_lag(0.02 + minute / 1000)
        recorder.keep_lag(0.3)
        if minute % 10 == 0:
            recorder.dead_by_task.update({"tests.charge": 2, "tests.mail": 1})
        recorder.write(60.0 * (minute + 1), depth=100 + minute * 3, polling=False)
        with connection.cursor() as cursor:  # the row just written, moved into the past
            cursor.execute(
                "UPDATE outbox_notify_sample_v1 SET at = at - %s * interval '1 minute'"
                " WHERE at > now() - interval '1 second'",
                [59 - minute],
            )
    store.close()
    with connection.cursor() as cursor:
        cursor.execute(HELD)
    yield
    clear_samples()


@pytest.fixture
def viewer() -> User:
    """Staff allowed to view outbox rows, nothing more."""
    user = User.objects.create_user("viewer", password=PASSWORD, is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_outboxmessage"))
    return user


def log_in(browser: Any, base: str, user: User) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{base}/admin/login/?next=/admin/")
    browser.find_element(By.NAME, "username").send_keys(user.username)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    # The click returns before the login's POST and redirect have loaded: a get() issued now
    # can lose the race to that redirect and end on the admin's index instead.
    WebDriverWait(browser, LOAD_TIMEOUT).until(
        lambda b: (
            "/admin/login/" not in b.current_url
            and b.execute_script("return document.readyState") == "complete"
        )
    )


def test_the_dashboard_draws_the_relays_samples_and_links_to_the_lists(
    browser: Any, live_server: Any, samples: None, viewer: User, tmp_path: Path
) -> None:
    """Six charts with lines, the relay listening, held ETAs on the timeline, a working link."""
    from selenium.webdriver.common.by import By

    log_in(browser, live_server.url, viewer)
    browser.get(f"{live_server.url}/admin/outbox_notify/outboxmessage/dashboard/")
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.outbox-chart")
    assert len(charts) == 7  # six over time, the held timeline
    lines = {
        line.get_attribute("data-series"): int(line.get_attribute("data-points"))
        for line in browser.find_elements(By.CSS_SELECTOR, "polyline.series")
    }
    assert lines["depth"] >= 55  # a point a minute over the hour
    assert lines["published/s"] >= 55
    assert lines["p99"] >= 55
    assert lines["tests.charge"] >= 5
    assert charts[0].size["width"] > 300  # drawn, not an empty box
    [relay] = browser.find_elements(By.CSS_SELECTOR, "#outbox-relays tbody tr")
    assert "listening" in relay.text
    assert str(os.getpid()) in relay.text
    assert len(browser.find_elements(By.CSS_SELECTOR, "circle.eta")) == 6
    assert browser.find_element(By.CSS_SELECTOR, "meta[http-equiv=refresh]")
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if SCREENSHOT:
        shutil.copyfile(shot, SCREENSHOT)
    browser.find_element(By.ID, "link-outbox").click()
    assert "/admin/outbox_notify/outboxmessage/" in browser.current_url
    assert browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")  # the held rows


def test_staff_without_the_view_permission_is_refused(
    browser: Any, live_server: Any, samples: None
) -> None:
    """A staff user who may not view the outbox gets 403, not the charts."""
    from selenium.webdriver.common.by import By

    user = User.objects.create_user("nobody", password=PASSWORD, is_staff=True)
    log_in(browser, live_server.url, user)
    browser.get(f"{live_server.url}/admin/outbox_notify/outboxmessage/dashboard/")
    assert not browser.find_elements(By.CSS_SELECTOR, "svg.outbox-chart")
    assert "403" in browser.page_source or "Forbidden" in browser.page_source
