"""Stopping the server processes that devtools starts."""

from __future__ import annotations

import subprocess
from typing import Any

STOP_TIMEOUT = 10.0  # seconds for SIGTERM to work before SIGKILL


def stop_process(process: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL if the process is still there after `timeout` s; reap it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)
