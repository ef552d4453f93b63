"""The pytest plugin as users meet it: a throwaway project run by pytester in a subprocess."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

import pytest

SETTINGS = """
from urllib.parse import urlsplit
url = urlsplit({url!r})
SECRET_KEY = "x"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "outbox_notify"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {name!r},
    "HOST": url.hostname, "PORT": str(url.port or 5432), "USER": url.username or "postgres",
    "TEST": {{"NAME": {test_name!r}}},
}}}}
OUTBOX_NOTIFY_CELERY_APP = "proj_celery.app"
"""

CELERY = """
from outbox_notify import OutboxCelery

app = OutboxCelery("proj")
app.conf.broker_url = "redis://127.0.0.1:1/0"  # never contacted: the outbox and the fake relay


@app.task(name="proj.hello")
def hello(name):
    return f"hello {name}"


@app.task(name="proj.start")
def start(name):
    hello.delay(name)  # a follow-up, itself queued through the outbox
"""

USER_TESTS = """
from django.db import transaction
from proj_celery import hello, start


def test_outbox_lists_what_the_test_queued(outbox):
    with transaction.atomic():
        hello.delay("ada")
    assert outbox.task_names == ["proj.hello"]
    assert len(outbox) == 1


def test_assert_task_sent_matches(assert_task_sent):
    hello.apply_async(("grace",))
    assert assert_task_sent("proj.hello", args=["grace"]).kwargs == {}


def test_assert_task_sent_failure_lists_the_queue(assert_task_sent):
    hello.delay("linus")
    assert_task_sent("proj.missing")


def test_fake_relay_publishes_through_the_relay(fake_relay, outbox):
    with transaction.atomic():
        result = hello.apply_async(("ken",), queue="greetings", headers={"x-h": 1})
    [message] = fake_relay.drain()
    assert (message.task_id, message.args, message.routing_key) == (result.id, ["ken"], "greetings")
    assert message.headers["x-h"] == 1
    assert len(outbox) == 0


def test_drain_outbox_runs_tasks_and_their_follow_ups(drain_outbox):
    start.delay("barbara")
    published = drain_outbox(run=True)
    assert [m.task_name for m in published] == ["proj.start", "proj.hello"]
"""


@pytest.fixture
def user_project(pytester: pytest.Pytester, pg_server_url: str) -> pytest.Pytester:
    """A throwaway Django project using outbox-notify, pointed at the session's server."""
    name = f"plugin_{uuid.uuid4().hex[:10]}"
    pytester.makepyfile(
        proj_settings=SETTINGS.format(url=pg_server_url, name=name, test_name=f"test_{name}"),
        proj_celery=CELERY,
        test_user=USER_TESTS,
    )
    pytester.makeini("[pytest]\nDJANGO_SETTINGS_MODULE = proj_settings\n")
    assert urlsplit(pg_server_url).hostname
    return pytester


def test_plugin_fixtures_work_in_a_user_project(user_project: pytest.Pytester) -> None:
    """outbox, assert_task_sent, fake_relay and drain_outbox behave as documented."""
    result = user_project.runpytest_subprocess("-p", "no:cacheprovider", "--ds=proj_settings")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*no task proj.missing was queued in the outbox; queued:*",
            "*proj.hello(args=*'linus'*, kwargs={})*",
        ]
    )
