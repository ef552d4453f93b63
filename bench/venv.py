"""The benchmark's own virtualenv: this checkout plus django-celery-outbox, matplotlib, py-spy.

Kept apart from .venv so the peer library never leaks into the test suite. Created on first
use and reinstalled only when the requirement list or pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from bench.procs import BenchError

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-bench"
STAMP = VENV / ".bench-installed"
PEER_REQUIREMENT = "django-celery-outbox==0.4.3"
REQUIREMENTS = (
    "-e",
    # fast: orjson, as a production install would use; test: bench.long_writer runs a test of
    # the suite (pytest-django and friends), and devtools.pgserver needs pytest-postgresql.
    f"{ROOT}[binary,redis,fast,test]",
    PEER_REQUIREMENT,
    "matplotlib>=3.7",
    "py-spy>=0.3.14",
)
INSTALL_TIMEOUT = 900  # seconds: a cold pip install from the package index


def python() -> Path:
    return VENV / "bin" / "python"


def _fingerprint() -> str:
    digest = hashlib.sha256("\n".join(REQUIREMENTS).encode())
    digest.update((ROOT / "pyproject.toml").read_bytes())
    return digest.hexdigest()


def inside() -> bool:
    """True when this interpreter is the benchmark venv's."""
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure() -> Path:
    """Create or update the venv when needed; the path of its python."""
    if STAMP.exists() and STAMP.read_text() == _fingerprint() and python().exists():
        return python()
    print(f"bench: preparing {VENV.name}/ (one-time pip install)", file=sys.stderr, flush=True)
    build(VENV, REQUIREMENTS)
    STAMP.write_text(_fingerprint())
    return python()


def build(venv: Path, pip_args: Sequence[str], *, upgrade_pip: bool = True) -> Path:
    """A venv at `venv` on this interpreter's Python, `pip install`ing `pip_args`; its python.

    pip keeps its cache (no --no-cache-dir): wheels the current environment was installed from
    are reused. tests/acceptance/test_upgrade.py builds the previous release's venv with it.
    """
    base = getattr(sys, "_base_executable", sys.executable)
    venv_python = venv / "bin" / "python"
    steps = [[base, "-m", "venv", str(venv)]]
    if upgrade_pip:
        steps.append([str(venv_python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    steps.append([str(venv_python), "-m", "pip", "install", "--quiet", *pip_args])
    for argv in steps:
        done = subprocess.run(argv, check=False, timeout=INSTALL_TIMEOUT)
        if done.returncode != 0:
            raise BenchError(f"creating the venv {venv} failed at: {' '.join(argv)}")
    return venv_python


def archive(rev: str, dest: Path, paths: Sequence[str]) -> None:
    """Extract `paths` as they are at commit `rev` of this repository into `dest`."""
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", rev, *paths],
            capture_output=True,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
    except FileNotFoundError as exc:
        raise BenchError("git is not installed") from exc
    if done.returncode != 0:
        raise BenchError(f"git archive {rev} failed: {done.stderr!r}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(dest, filter="data")


def pins(path: Path) -> Path:
    """This interpreter's releases as pip constraints (outbox-notify left out), in `path`.

    Another commit's venv built under them runs on the same Celery, kombu, psycopg and Django.
    """
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=True,
    ).stdout
    lines = [
        line
        for line in frozen.splitlines()
        if "==" in line and not line.lower().startswith(("outbox-notify==", "outbox_notify=="))
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def reexec(argv: list[str]) -> None:
    """Replace this process with the same `python -m bench.run` inside the benchmark venv."""
    interpreter = ensure()
    os.execv(interpreter, [str(interpreter), "-m", "bench.run", *argv])  # noqa: S606
