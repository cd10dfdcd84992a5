"""The tests' wait for a process's output line: it returns what was written once the
line is there, and fails with the output (never blocks) when the process exits first or
stays silent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omlx_core.testing.waiting import wait_for_output


def started(script: str, log: Path) -> subprocess.Popen:
    with log.open("wb") as output:
        return subprocess.Popen([sys.executable, "-c", script], stdout=output,
                                stderr=subprocess.STDOUT)


def test_the_wait_returns_the_output_once_the_line_is_written(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    process = started("import time; print('starting', flush=True); time.sleep(0.2); "
                      "print('ready: here', flush=True); time.sleep(60)", log)
    try:
        seen = wait_for_output(process, log, "ready: here", timeout=60)
        assert seen.startswith("starting\n") and "ready: here" in seen
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_process_that_exits_without_the_line_fails_the_wait_with_its_output(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    process = started("print('port in use'); raise SystemExit(3)", log)
    with pytest.raises(AssertionError, match=r"exited with status 3(.|\n)*port in use"):
        wait_for_output(process, log, "ready", timeout=60)


def test_a_silent_process_fails_the_wait_at_its_timeout_instead_of_blocking(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    process = started("import time; print('loading', flush=True); time.sleep(60)", log)
    try:
        with pytest.raises(AssertionError, match=r"did not write it within 1 s(.|\n)*loading"):
            wait_for_output(process, log, "ready", timeout=1)
        assert process.poll() is None
    finally:
        process.kill()
        process.wait(timeout=30)
