"""Run a management command as a subprocess, its stderr on a pipe (cron) or a terminal (pty)."""

from __future__ import annotations

import dataclasses
import os
import pty
import select
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


def run_command(
    env: dict[str, Any], *argv: str, tty: bool = False, stdout_tty: bool = False
) -> Ran:
    """`python -m django ARGV`; with `tty`, stderr is a pseudo-terminal and stdout a pipe (a
    terminal too with `stdout_tty`, as in an interactive shell, where Django turns colours on)."""
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
    err_controller, err_terminal = pty.openpty()
    out_controller, out_terminal = pty.openpty() if stdout_tty else (None, None)
    try:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out_terminal if out_terminal is not None else subprocess.PIPE,
            stderr=err_terminal,
        )
    finally:
        os.close(err_terminal)
        if out_terminal is not None:
            os.close(out_terminal)
    if out_controller is None:
        stderr = _read_all([err_controller])[err_controller]
        assert proc.stdout is not None
        stdout = proc.stdout.read()
        proc.stdout.close()
    else:
        seen = _read_all([err_controller, out_controller])
        stderr, stdout = seen[err_controller], seen[out_controller]
    return Ran(proc.wait(timeout=COMMAND_TIMEOUT), stdout.decode(), stderr.decode(errors="replace"))


def _read_all(controllers: list[int]) -> dict[int, bytes]:
    """Everything written to these terminals until the command closed them; closes them."""
    seen = {fd: bytearray() for fd in controllers}
    open_fds = set(controllers)
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [], COMMAND_TIMEOUT)
        if not ready:
            raise TimeoutError(f"no output for {COMMAND_TIMEOUT} s")
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the command closed the terminal (it exited)
                data = b""
            if data:
                seen[fd] += data
            else:
                open_fds.discard(fd)
                os.close(fd)
    return {fd: bytes(data) for fd, data in seen.items()}
