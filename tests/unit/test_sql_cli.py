"""`python -m outbox_notify.sql`: every packaged SQL file, listed and printed byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from outbox_notify import sql

REPO = Path(__file__).resolve().parents[2]
EVERY_FILE = sorted(path.relative_to(REPO / "sql").as_posix() for path in REPO.glob("sql/**/*.sql"))


def test_without_a_name_it_lists_every_sql_file(capsys: pytest.CaptureFixture[str]) -> None:
    """The list is every .sql file of the sql/ folder, the migrations' included, one a line."""
    sql.main([])
    assert capsys.readouterr().out.splitlines() == EVERY_FILE
    assert "relay_role.sql" in EVERY_FILE
    assert "migrations/0001_initial.sql" in EVERY_FILE


@pytest.mark.parametrize("name", EVERY_FILE)
def test_each_file_prints_byte_for_byte(
    name: str, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """NAME prints the file exactly as the package reads it, nothing added."""
    sql.main([name])
    assert capfdbinary.readouterr().out == (REPO / "sql" / name).read_bytes()


def test_the_suffix_may_be_left_out(capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    """`relay_role` names relay_role.sql."""
    sql.main(["relay_role"])
    assert capfdbinary.readouterr().out == (REPO / "sql" / "relay_role.sql").read_bytes()


@pytest.mark.parametrize("name", ["nope.sql", "../pyproject.toml", "migrations"])
def test_a_name_that_is_no_packaged_file_is_a_usage_error_listing_them(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 (argparse), the message naming what was asked and every file there is."""
    with pytest.raises(SystemExit) as excinfo:
        sql.main([name])
    assert excinfo.value.code == 2
    error = capsys.readouterr().err
    assert f"no SQL file named {name!r}" in error
    assert "install.sql, migrations/0001_initial.reverse.sql" in error


def test_it_runs_as_a_module_without_django_settings(tmp_path: Path) -> None:
    """`python -m outbox_notify.sql install.sql` works with no settings module, from anywhere."""
    result = subprocess.run(
        [sys.executable, "-m", "outbox_notify.sql", "install.sql"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    assert result.stdout == (REPO / "sql" / "install.sql").read_bytes()
