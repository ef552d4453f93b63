"""The reference and install pages say what the code does: names, ids, flags, senders, commands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.core.management import load_command_class
from django.db import transaction

from outbox_notify import checks, conf, signals
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
    """install.md's commands write install.sql and uninstall.sql byte for byte (editable install)."""
    text = (DOCS / "install.md").read_text()
    commands = re.findall(r"^\$ (python -c .*sql\.read.* > (\w+\.sql))$", text, re.MULTILINE)
    assert [name for _, name in commands] == ["install.sql", "uninstall.sql"]
    for command, name in commands:
        subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=subprocess_env, check=True, timeout=60
        )
        assert (tmp_path / name).read_bytes() == (ROOT / "sql" / name).read_bytes()
