"""A hang fails the suite, naming the test that hung: every test runs under
pytest-timeout's limit (pyproject's ``timeout``; slow tests get conftest's
``SLOW_TIMEOUT_S``), shown here by running the conformance kit on an engine that
deadlocks, in a pytest of its own with the repository's configuration and a short limit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DEADLOCKED_ENGINE = '''
import threading

import pytest

from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.testing.conformance import EngineConformance
from omlx_core.testing.host import make_test_host


class DeadlockedEngine(BatchedEngine):
    """Its submit waits on a lock nobody releases: a deadlock, not a slow engine."""

    def submit(self, request):
        never = threading.Lock()
        never.acquire()
        never.acquire()


class TestDeadlockedEngine(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        engine = DeadlockedEngine(spec_for_path(tiny_model_path("llama")),
                                  make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()
'''


def test_the_suite_has_a_per_test_time_limit(pytestconfig) -> None:
    assert float(pytestconfig.getini("timeout")) > 0, "pyproject sets no pytest-timeout limit"


@pytest.mark.slow  # a pytest run of its own
def test_a_deadlocked_engine_fails_the_run_naming_the_test(tmp_path) -> None:
    module = tmp_path / "test_deadlock.py"
    module.write_text(textwrap.dedent(DEADLOCKED_ENGINE))
    env = {**os.environ, "OMLX_CACHE_DIR": str(tmp_path / "cache"), "OMLX_NO_BLAS_REEXEC": "1",
           "OMLX_CPU_KERNELS": "0"}
    # The limit shortened to 5 s and kept to the test call: the engine's start (a fixture)
    # takes what it takes on a loaded machine; only the deadlock must trip it.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(module), "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-p", "omlx_core.testing.pytest_fixtures",
         "-p", "no:cacheprovider", "-o", "timeout=5", "-o", "timeout_func_only=true", "-q",
         "-n", "0",
         "-k", "test_streams_tokens_as_they_come_and_ends_with_usage or test_max_tokens"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    for check in ("test_streams_tokens_as_they_come_and_ends_with_usage",
                  "test_max_tokens_is_never_exceeded[1]", "test_max_tokens_is_never_exceeded[5]"):
        assert f"FAILED test_deadlock.py::TestDeadlockedEngine::{check}" in output, output
    # Each failure's report says it was the limit, not an error (the short summary repeats
    # the reason only where the terminal is wide enough: not counted).
    reasons = re.findall(r"^E\s+Failed: Timeout \(>5\.0s\) from pytest-timeout", output, re.MULTILINE)
    assert len(reasons) == 3, output
    assert "3 failed" in output, output
