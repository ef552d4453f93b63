"""The reference and install pages say what the code does: names, ids, flags, senders, commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.contrib import admin
from django.core.management import load_command_class
from django.db import transaction
from django.db.migrations.loader import MigrationLoader

from outbox_notify import checks, conf, signals
from outbox_notify.events.consumer import Outcome
from tests.celery_app import add
from tests.relay_support import ROOT

DOCS = ROOT / "docs"
DJANGO_OPTIONS = {
    "--help",
    "--version",
    "--verbosity",
    "--settings",
    "--pythonpath",
    "--traceback",
    "--no-color",
    "--force-color",
    "--skip-checks",
}
COMMANDS = (
    "outbox_listen",
    "outbox_sweep",
    "outbox_stats",
    "outbox_purge_dead_letter",
    "outbox_requeue_dead_letter",
    "outbox_purge_inbox",
    "outbox_list",
    "outbox_consume",
    "outbox_consume_dead",
)


def _section(page: str, heading: str) -> str:
    """The text of a Markdown section, from its heading to the next heading of its level."""
    text = (DOCS / page).read_text()
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n")
    following = re.search(rf"^{level} ", text[start + len(heading) :], re.MULTILINE)
    return text[start : start + len(heading) + (following.start() if following else len(text))]


def _table_first_column(section: str) -> list[str]:
    return re.findall(r"^\| `([^`]+)`", section, re.MULTILINE)


def test_the_settings_table_lists_exactly_the_settings_the_code_reads() -> None:
    """Every setting conf.py knows is documented, and nothing else is."""
    documented = _table_first_column(_section("reference.md", "## Settings"))
    assert sorted(documented) == sorted(conf.KNOWN_SETTINGS)


def test_the_documented_size_limit_default_is_the_code_default() -> None:
    """The reference gives OUTBOX_NOTIFY_MAX_MESSAGE_BYTES's real default."""
    row = next(
        line
        for line in _section("reference.md", "## Settings").splitlines()
        if line.startswith("| `OUTBOX_NOTIFY_MAX_MESSAGE_BYTES`")
    )
    assert f"`{conf.DEFAULT_MAX_MESSAGE_BYTES}` (10 MiB)" in row


@pytest.mark.parametrize(
    ("page", "heading"), [("reference.md", "## System checks"), ("install.md", "## System checks")]
)
def test_the_check_tables_list_exactly_the_check_ids_the_code_emits(
    page: str, heading: str
) -> None:
    """Both check tables list each id the package can report, and no other."""
    package = Path(checks.__file__).parent
    source = "".join(path.read_text() for path in package.rglob("*.py"))
    emitted = set(re.findall(r'id="(outbox_notify\.[EW]\d{3})"', source))
    documented = _table_first_column(_section(page, heading))
    assert sorted(documented) == sorted(emitted)


def test_the_log_event_tables_list_every_event_the_package_logs() -> None:
    """Each event name in a log call of outbox_notify is in the reference's Log events tables,
    and each name there is one the package uses (the two built from a prefix included)."""
    package = Path(checks.__file__).parent
    source = "".join(path.read_text() for path in package.rglob("*.py"))
    logged = set(
        re.findall(
            r'\.(?:debug|info|warning|error|exception)\(\s*"(outbox\.[a-z_]+)"\s*[,)]', source
        )
    )
    literals = set(re.findall(r'"(outbox\.[a-z_]+)"', source))
    # delivery.py logs "outbox.event_" + the outcome of a handled or skipped message
    built = {f"outbox.event_{outcome.value}" for outcome in (Outcome.HANDLED, Outcome.SKIPPED)}
    documented = set(_table_first_column(_section("reference.md", "## Log events")))
    assert sorted(logged - documented) == []
    assert sorted(documented - literals - built) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_command_is_documented_in_its_section(command: str) -> None:
    """Each command's own flags appear in its reference section (Django's own are not repeated)."""
    parser = load_command_class("outbox_notify", command).create_parser("manage.py", command)
    flags = {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option not in DJANGO_OPTIONS
    }
    section = _section("reference.md", f"### `{command}`")
    missing = sorted(flag for flag in flags if f"`{flag}" not in section)
    assert missing == []


def test_every_admin_action_is_documented_under_its_menu_label() -> None:
    """operations.md's admin section describes each action of the outbox admins, and no other."""
    labels = [
        str(getattr(model_admin, name).short_description)
        for model, model_admin in admin.site._registry.items()
        if model._meta.app_label == "outbox_notify"
        for name in model_admin.actions or ()
    ]
    documented = re.findall(r"^- \*\*(.+?)\*\* \(", _section("operations.md", "## The admin"), re.M)
    assert sorted(documented) == sorted(labels)
    assert len(labels) == 3


def test_install_md_fakes_the_last_migration_after_install_sql() -> None:
    """install.sql builds every migration's schema: the page must fake up to the last one."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    (last,) = [name for app, name in loader.graph.leaf_nodes() if app == "outbox_notify"]
    section = _section("install.md", "### By hand, with psql (for DBAs)")
    faked = re.findall(r"migrate outbox_notify (\w+) --fake", section)
    named = re.findall(r"`(\d{4}_\w+)`", section)
    assert faked == [last]
    assert named == [last]


def _fenced_after(text: str, marker: str) -> list[str]:
    """The lines of the first fenced block after `marker`."""
    after = text.split(marker, 1)[1]
    return after.split("```", 2)[1].split("\n")[1:-1]


def test_the_system_check_block_is_what_django_prints(
    tmp_path: Path, subprocess_env: dict[str, Any]
) -> None:
    """reference.md's `check` output for its two example settings is what `check` prints."""
    section = _section("reference.md", "## System checks")
    settings_lines = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = _fenced_after(section, "test_docs_match_code.py runs this command")
    assert shown[0] == "$ python manage.py check"
    (tmp_path / "check_settings.py").write_text("from tests.settings import *\n" + settings_lines)
    env = {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "check_settings",
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env['PYTHONPATH']}",
    }
    result = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == shown[1:]


def _documented_exit_code(command: str, flag: str) -> int:
    """The code a command's "Exit codes: 0 ...; 1 ...; 2 ..." sentence gives an error of `flag`."""
    section = _section("reference.md", f"### `{command}`")
    sentence = re.search(r"Exit codes: (.*?)\.(?:\s|$)", section, re.DOTALL)
    assert sentence, f"no 'Exit codes:' sentence in the section of {command}"
    codes = [
        int(part[0]) for part in sentence.group(1).split("; ") if f"`{flag}`" in part.split("(")[-1]
    ]
    assert len(codes) == 1, f"the exit codes of {command} name {flag} {len(codes)} times"
    return codes[0]


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("outbox_purge_dead_letter", ["--older-than-days", "-1"]),
        ("outbox_purge_dead_letter", ["--chunk-size", "0"]),
        ("outbox_requeue_dead_letter", ["--all", "--chunk-size", "0"]),
        ("outbox_purge_inbox", ["--older-than-days", "-1"]),
        ("outbox_purge_inbox", ["--chunk-size", "0"]),
    ],
)
def test_a_flag_out_of_range_exits_with_the_documented_code(
    command: str, argv: list[str], subprocess_env: dict[str, Any]
) -> None:
    """The command, run as a subprocess, exits with the code its reference section gives."""
    flag = argv[-2]
    result = subprocess.run(
        [sys.executable, "-m", "django", command, *argv],
        cwd=ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == _documented_exit_code(command, flag), result.stderr
    assert result.stderr.startswith("usage:")
    assert f"argument {flag}: must be at least" in result.stderr


def test_every_signal_is_documented_with_the_outbox_notify_sender() -> None:
    """The signals table gives "outbox_notify" as the sender of each of the four signals."""
    rows = [
        line
        for line in _section("reference.md", "## Signals").splitlines()
        if line.startswith("| `outbox_message_")
    ]
    assert len(rows) == 4
    for row in rows:
        assert row.split("|")[3].strip() == '`"outbox_notify"`', row


@pytest.mark.django_db(transaction=True)
def test_created_and_sent_signals_arrive_with_the_documented_sender(fake_relay: Any) -> None:
    """A receiver connected with sender="outbox_notify" gets created (commit) and sent (relay)."""
    # transaction=True: outbox_message_created is sent on commit.
    received: list[tuple[str, Any]] = []

    def created(sender: Any, **kwargs: Any) -> None:
        received.append(("created", sender))

    def sent(sender: Any, **kwargs: Any) -> None:
        received.append(("sent", sender))

    signals.outbox_message_created.connect(created, sender="outbox_notify")
    signals.outbox_message_sent.connect(sent, sender="outbox_notify")
    try:
        with transaction.atomic():
            add.delay(1, 2)
        fake_relay.drain()
    finally:
        signals.outbox_message_created.disconnect(created, sender="outbox_notify")
        signals.outbox_message_sent.disconnect(sent, sender="outbox_notify")
    assert received == [("created", "outbox_notify"), ("sent", "outbox_notify")]


def test_the_documented_way_to_write_out_the_sql_files_works(
    tmp_path: Path, subprocess_env: dict[str, Any]
) -> None:
    """Every `python -m outbox_notify.sql NAME > FILE` of the docs writes the file byte for byte."""
    found = [
        (page, command, name)
        for page in ("install.md", "security.md", "reference.md")
        for command, name in re.findall(
            r"^\s*\$ (python -m outbox_notify\.sql (\S+) > \S+)$",
            (DOCS / page).read_text(),
            re.MULTILINE,
        )
    ]
    names = {name for _, _, name in found}
    assert {"install.sql", "uninstall.sql", "relay_role.sql"} <= names
    assert any(name.startswith("migrations/") for name in names)
    env = {key: value for key, value in subprocess_env.items() if key != "DJANGO_SETTINGS_MODULE"}
    for page, command, name in found:
        result = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, timeout=60, check=False
        )
        assert result.returncode == 0, (page, command)
        written = tmp_path / command.rsplit("> ", 1)[1]
        assert written.read_bytes() == (ROOT / "sql" / name).read_bytes(), (page, command)
