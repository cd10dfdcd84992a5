"""The engine conformance suite (omlx_core.testing.conformance) against the engines
that ship with omlx-core — the built-in ``batched`` and ``distributed`` engines and the
third-party example ``sequential`` engine (loaded from examples/, as a plugin author
would test it); the ``dflash`` and ``vlm`` engines run it in their own test modules —
and against mutants of the example engine that each break one promise, which the suite
must reject."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from omlx_core.engine import GenerationRequest
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.testing.conformance import EngineConformance
from omlx_core.testing.host import make_test_host

EXAMPLE_SRC = Path(__file__).resolve().parent.parent / "examples" / "sequential-engine" / "src"


def sequential_engine_class() -> type:
    sys.path.insert(0, str(EXAMPLE_SRC))
    try:
        from omlx_sequential_engine import SequentialEngine
    finally:
        sys.path.remove(str(EXAMPLE_SRC))
    return SequentialEngine


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


class TestDistributedEngineOneRank(EngineConformance):
    """The ``distributed`` engine in a group of one (no ``mlx.launch``): the same steps
    and step exchange; several ranks are served in tests/test_distributed.py."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        from omlx_core.plugins.distributed.engine import DistributedEngine

        engine = DistributedEngine(spec_for_path(tiny_model_path("llama")),
                                   make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()


class TestSequentialExampleEngine(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        engine = sequential_engine_class()(spec_for_path(tiny_model_path("llama")),
                                           make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()


# -- mutants: the example engine with one promise broken, through its public methods ------


def mutant(name: str, breaks_submit=None, abort_does_nothing: bool = False) -> type:
    """A subclass of the example engine whose ``submit`` changes each request's sampling
    with ``breaks_submit`` and whose ``abort`` may do nothing."""
    base = sequential_engine_class()

    def submit(self, request: GenerationRequest):
        if breaks_submit is not None:
            request = dataclasses.replace(request, sampling=breaks_submit(request.sampling))
        return base.submit(self, request)

    def abort(self, request_id: str) -> None:
        if not abort_does_nothing:
            base.abort(self, request_id)

    return type(name, (base,), {"submit": submit, "abort": abort})


MUTANTS = {
    # forces temperature 0 and drops the seed: the engine that passed the old kit
    "always-greedy": mutant("AlwaysGreedy", lambda s: dataclasses.replace(
        s, temperature=0.0, seed=None)),
    "no-abort": mutant("NoAbort", abort_does_nothing=True),
    "ignores-max-tokens": mutant("IgnoresMaxTokens", lambda s: dataclasses.replace(
        s, max_tokens=10_000)),
    "ignores-stop": mutant("IgnoresStop", lambda s: dataclasses.replace(s, stop_token_ids=())),
}

#: each mutant, and every check of the kit that must reject it
REJECTED_BY = [
    ("always-greedy", "test_sampling_follows_the_models_distribution", {}),
    ("always-greedy", "test_top_k_is_honoured", {}),
    ("always-greedy", "test_top_p_is_honoured", {}),
    ("always-greedy", "test_min_p_is_honoured", {}),
    ("always-greedy", "test_a_seed_fixes_the_tokens_and_another_seed_changes_them", {}),
    ("no-abort", "test_abort_ends_a_running_request_within_a_few_tokens", {}),
    ("no-abort", "test_abort_before_the_first_token_ends_the_request", {}),
    ("no-abort", "test_closing_the_handle_aborts_and_the_engine_goes_on", {}),
    ("no-abort", "test_a_stop_string_is_cut_by_the_pipeline_and_aborts_the_request", {}),
    ("ignores-max-tokens", "test_max_tokens_is_never_exceeded", {"max_tokens": 1}),
    ("ignores-max-tokens", "test_max_tokens_is_never_exceeded", {"max_tokens": 5}),
    ("ignores-max-tokens", "test_streams_tokens_as_they_come_and_ends_with_usage", {}),
    ("ignores-stop", "test_stop_token_ids_end_the_request", {}),
]


@pytest.mark.parametrize("name, check, arguments", REJECTED_BY,
                         ids=[f"{name}-{check[5:]}{''.join(f'-{v}' for v in args.values())}"
                              for name, check, args in REJECTED_BY])
def test_the_kit_rejects_an_engine_that_breaks_a_promise(tiny_model_path, name, check,
                                                         arguments) -> None:
    engine = MUTANTS[name](spec_for_path(tiny_model_path("llama")), make_test_host("cpu-small"))
    engine.start()
    try:
        with pytest.raises(AssertionError) as failure:
            try:
                getattr(EngineConformance(), check)(engine, **arguments)
            except pytest.skip.Exception as skipped:
                pytest.fail(f"the kit skipped {check} on the {name} mutant: {skipped}")
    finally:
        engine.shutdown()
    print(f"{name}: {check} fails with: {failure.value}")
