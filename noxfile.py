"""The version matrix: the whole suite on the oldest and on the newest releases we support.

`make test` runs both sessions after lint; `nox -s oldest` or `nox -s newest` runs one. Each
session installs the package (editable, with its test extras) under the pins of
constraints/<session>.txt and runs pytest over every test; arguments after `--` go to pytest.
The supported ranges and why they end where they do are in docs/install.md.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["oldest", "newest"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"  # pip re-applies the pins on every run (CI starts from a clone)
nox.options.download_python = "never"  # this machine reaches no interpreter downloads
# A missing interpreter skips its session locally and fails it under CI=true (nox's default).

EXTRAS = ".[test,redis,sentry,datadog,otel,prometheus]"
OLDEST_PYTHON = "3.11"
NEWEST_PYTHON = "3.13"


def _runs(python: str) -> bool:
    try:
        return (
            subprocess.run([python, "--version"], capture_output=True, check=False).returncode == 0
        )
    except OSError:
        return False


def _interpreter(version: str) -> str:
    """An absolute path to a Python `version`: OUTBOX_PYTHON_3_13-style override, PATH, pyenv.

    pyenv's shims answer for every installed version but run only the selected one, so the
    versions pyenv installed are looked up in its own tree as well.
    """
    override = os.environ.get(f"OUTBOX_PYTHON_{version.replace('.', '_')}")
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = [
        override,
        shutil.which(f"python{version}"),
        *sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"), reverse=True),
    ]
    for candidate in candidates:
        if candidate and _runs(candidate):
            return candidate
    return version  # nox reports it missing: skipped locally, a failure under CI=true


def _suite(session: nox.Session, pins: str) -> None:
    session.install("--quiet", "-c", f"constraints/{pins}.txt", "-e", EXTRAS)
    session.run("python", "-m", "devtools.versions")  # which releases this run tests
    session.run("pytest", *session.posargs)


@nox.session(python=_interpreter(OLDEST_PYTHON))
def oldest(session: nox.Session) -> None:
    """The whole suite on Python 3.11 and the lowest release of every dependency."""
    _suite(session, "oldest")


@nox.session(python=_interpreter(NEWEST_PYTHON))
def newest(session: nox.Session) -> None:
    """The whole suite on Python 3.13 and the newest tested release of every dependency."""
    _suite(session, "newest")
