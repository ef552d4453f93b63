"""Stopping the server processes that devtools starts."""

from __future__ import annotations

import subprocess

STOP_TIMEOUT = 10.0  # seconds for SIGTERM to work before SIGKILL


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the process is still there after STOP_TIMEOUT; reap it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT)
