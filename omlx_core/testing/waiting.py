"""Small helpers for tests that drive servers and engines from another thread."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Callable


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms until it holds or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_output(process: subprocess.Popen, log: Path, text: str, timeout: float) -> str:
    """Wait until ``log``, the file ``process`` writes its output to, holds ``text``; the
    log's content then. Fails with the log's end when the process exits first or
    ``timeout`` passes. (A read from the process's pipe would block for as long as the
    process says nothing, past any deadline.)"""

    def output() -> str:
        return log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""

    wait_for(lambda: text in output() or process.poll() is not None, timeout)
    seen = output()
    if text not in seen:
        what = (f"exited with status {process.returncode}" if process.poll() is not None
                else f"did not write it within {timeout:.0f} s")
        raise AssertionError(f"waiting for {text!r}, the process {what}; its output ends:\n"
                             f"{seen[-4000:]}")
    return seen
