"""The benchmark's own virtualenv: this checkout plus django-celery-outbox, matplotlib, py-spy.

Kept apart from .venv so the peer library never leaks into the test suite. Created on first
use and reinstalled only when the requirement list or pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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


def reexec(argv: list[str]) -> None:
    """Replace this process with the same `python -m bench.run` inside the benchmark venv."""
    interpreter = ensure()
    os.execv(interpreter, [str(interpreter), "-m", "bench.run", *argv])  # noqa: S606
