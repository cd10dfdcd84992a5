"""The engine conformance suite (omlx_core.testing.conformance) against both engines
that ship with omlx-core: the built-in ``batched`` engine and the third-party example
``sequential`` engine (loaded from examples/, as a plugin author would test it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.testing.conformance import EngineConformance
from omlx_core.testing.host import make_test_host

EXAMPLE_SRC = Path(__file__).resolve().parent.parent / "examples" / "sequential-engine" / "src"


class TestBatchedEngine(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()


class TestBatchedEngineHybrid(EngineConformance):
    """A model with non-cuttable (ArraysCache) layers takes other prefill paths."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        engine = BatchedEngine(spec_for_path(tiny_model_path("qwen3_next")),
                               make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()


class TestSequentialExampleEngine(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        sys.path.insert(0, str(EXAMPLE_SRC))
        try:
            from omlx_sequential_engine import SequentialEngine
        finally:
            sys.path.remove(str(EXAMPLE_SRC))
        engine = SequentialEngine(spec_for_path(tiny_model_path("llama")), make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()
