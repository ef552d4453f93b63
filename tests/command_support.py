"""Run a management command as a subprocess, its stderr on a pipe (cron) or a terminal (pty)."""

from __future__ import annotations

import dataclasses
import os
import pty
import subprocess
import sys
from typing import Any

from tests.relay_support import ROOT

COMMAND_TIMEOUT = 120  # seconds; generous, the commands here end on their own


@dataclasses.dataclass(frozen=True)
class Ran:
    """What a command printed, and how it exited."""

    returncode: int
    stdout: str
    stderr: str


def run_command(env: dict[str, Any], *argv: str, tty: bool = False) -> Ran:
    """`python -m django ARGV`; with `tty`, stderr is a pseudo-terminal and stdout a pipe."""
    command = [sys.executable, "-m", "django", *argv]
    if not tty:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
        return Ran(done.returncode, done.stdout, done.stderr)
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=terminal)
    finally:
        os.close(terminal)
    seen = bytearray()
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # EIO: the command closed the terminal (it exited)
            break
        if not data:
            break
        seen += data
    os.close(controller)
    assert proc.stdout is not None
    stdout = proc.stdout.read().decode()
    proc.stdout.close()
    return Ran(proc.wait(timeout=COMMAND_TIMEOUT), stdout, seen.decode(errors="replace"))
