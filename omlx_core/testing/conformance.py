"""The engine conformance suite: what every engine owes the serving pipeline, as tests.

Run it against your own engine by subclassing :class:`EngineConformance` in a test
module and giving it an ``engine`` fixture that yields a started engine (the tiny
random-weight models of :mod:`omlx_core.testing` are made for this)::

    import pytest
    from omlx_core.models.registry import spec_for_path
    from omlx_core.testing import make_test_host
    from omlx_core.testing.conformance import EngineConformance

    pytest_plugins = ["omlx_core.testing.pytest_fixtures"]   # tiny_model_path

    class TestMyEngine(EngineConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def engine(cls, tiny_model_path):
            engine = MyEngine(spec_for_path(tiny_model_path("llama")), make_test_host())
            engine.start()
            yield engine
            engine.shutdown()

It checks, on the engine object itself (no server): streaming token ids, cancellation,
stop token ids, ``max_tokens``, seeded determinism, the limits and memory hints, that a
forward-gate refusal ends only the refused request, and that the engine's
``detokenizer()`` serves the pipeline's output processor: a stop string is cut where
the pipeline cuts it and the engine request it aborts then ends with ``"abort"``. The forward gate is installed on the object the real
``resolve_scheduler`` hook finds for the engine (the installed plugins answer), so a
receiver that is never reached fails here rather than in production.
"""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

from omlx_core.engine import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    GuardedEngine,
    RequestHandle,
    SamplingParams,
)
from omlx_core.memory.gate import ForwardGate, MemoryReceiver, PrefillStep, Refusals
from omlx_core.memory.types import Rejection, RequestRejected
from omlx_core.serving.output import OutputProcessor

#: a prompt long enough that every engine prefills it before its first token
PROMPT = [(17 * i) % 90 + 20 for i in range(40)]


def fresh_prompt(salt: int) -> list[int]:
    """A prompt no earlier request shares a prefix with (a prefix cache cannot skip its
    prefill)."""
    return [(salt * 31 + 13 * i) % 90 + 20 for i in range(40)]
#: seconds any one request of the suite may take on a tiny model before it is a hang
TIMEOUT_S = 60.0


def run(engine: Engine, request_id: str, **sampling: object) -> list[GenerationOutput]:
    """Every output of one request, the final one last (fails on a hang)."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **sampling})  # type: ignore[arg-type]
    handle = engine.submit(GenerationRequest(request_id, PROMPT, params))
    return collect(handle)


def collect(handle: RequestHandle) -> list[GenerationOutput]:
    outputs: list[GenerationOutput] = []
    done = threading.Event()

    def read() -> None:
        try:
            for output in handle:
                outputs.append(output)
                if output.finished:
                    break
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(TIMEOUT_S), f"request {handle.request_id} did not finish in {TIMEOUT_S} s"
    handle.close()
    return outputs


def text_of(engine: Engine, outputs: list[GenerationOutput]) -> str:
    """The text of a request's outputs, as the serving pipeline makes it."""
    processor = OutputProcessor(engine.detokenizer())
    text = "".join(processor.add(o.token_ids).text for o in outputs)
    return text + processor.finish().text


def run_until_stop(engine: Engine, request: GenerationRequest,
                   stop: str) -> tuple[str, list[GenerationOutput], OutputProcessor]:
    """What the pipeline does with a stop string: outputs through an output processor
    until the stop matches, then the handle is closed (aborting the engine request) and
    read to its final output. Returns the text, every output the engine sent, and the
    processor."""
    request_id = request.request_id
    handle = engine.submit(request)
    processor = OutputProcessor(engine.detokenizer(), (stop,))
    outputs: list[GenerationOutput] = []
    text: list[str] = []
    done = threading.Event()

    def read() -> None:
        try:
            while True:
                output = handle.next_output()
                if output is None:
                    continue
                outputs.append(output)
                text.append(processor.add(output.token_ids).text)
                if processor.stopped and not output.finished:
                    handle.close()
                if output.finished:
                    if not processor.stopped:
                        text.append(processor.finish().text)
                    return
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(TIMEOUT_S), f"request {request_id} did not finish in {TIMEOUT_S} s"
    handle.close()
    return "".join(text), outputs, processor


def tokens_of(outputs: list[GenerationOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


class _RefuseOne(ForwardGate):
    """A gate that refuses one request id before its forward and lets all else run."""

    def __init__(self, victim: str):
        self.victim = victim
        self.asked = 0

    def check_prefill(self, step: PrefillStep) -> Refusals:
        self.asked += 1
        return {chunk.request_id: RequestRejected(Rejection(
            estimated_bytes=1, limit_bytes=1, breakdown=None, request_id=chunk.request_id,
            model_id=step.model_id, stage="forward", cause="memory_short",
            detail="refused by the conformance suite's gate"), retry_after_s=1.0)
            for chunk in step.chunks if chunk.request_id == self.victim}

    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        return {}


class EngineConformance:
    """Subclass in a test module and provide an ``engine`` fixture (a started engine)."""

    @pytest.fixture
    def engine(self) -> Iterator[Engine]:  # pragma: no cover - every subclass overrides it
        pytest.fail("give the conformance suite an `engine` fixture that yields a started engine")
        yield  # type: ignore[misc]

    def receiver(self, engine: Engine) -> MemoryReceiver:
        """The engine's memory receiver, as the installed plugins resolve it."""
        from omlx_core.pluginmanager import build_plugin_manager

        found = build_plugin_manager().hook.resolve_scheduler(engine=engine)
        assert isinstance(found, MemoryReceiver), (
            f"no installed plugin's resolve_scheduler returns a MemoryReceiver for "
            f"{type(engine).__qualname__} (got {found!r}): the enforcer could not reach it")
        return found

    # -- the contract's shape -----------------------------------------------------------

    def test_limits_and_memory_hints(self, engine: Engine) -> None:
        limits = engine.limits()
        assert limits.vocab_size > max(PROMPT)
        assert limits.max_running >= 1
        assert limits.context_length is None or limits.context_length > len(PROMPT)
        assert isinstance(engine, GuardedEngine), "the engine is not memory-guarded"
        hints = engine.memory_hints()
        assert hints.prefill_step_size >= 1
        assert hints.activation_dtype_bytes in (1, 2, 4, 8)
        self.receiver(engine)

    # -- outputs ---------------------------------------------------------------------------

    def test_streams_tokens_as_they_come_and_ends_with_usage(self, engine: Engine) -> None:
        outputs = run(engine, "stream", max_tokens=6)
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert final.finish_reason in ("stop", "length")
        assert final.usage is not None and final.usage.prompt_tokens == len(PROMPT)
        generated = len(tokens_of(outputs))
        assert final.usage.completion_tokens >= generated
        if generated >= 2:
            assert len(outputs) >= 2, "every token arrived in one output: nothing was streamed"

    @pytest.mark.parametrize("max_tokens", [1, 5])
    def test_max_tokens_is_never_exceeded(self, engine: Engine, max_tokens: int) -> None:
        outputs = run(engine, f"max-{max_tokens}", max_tokens=max_tokens)
        final = outputs[-1]
        assert final.usage is not None and final.usage.completion_tokens <= max_tokens
        if final.finish_reason == "length":
            assert final.usage.completion_tokens == max_tokens

    def test_a_stop_string_is_cut_by_the_pipeline_and_aborts_the_request(self, engine: Engine) -> None:
        reference = text_of(engine, run(engine, "stop-ref", max_tokens=24))
        stop = next((reference[i:i + 3] for i in range(2, len(reference) - 3)
                     if reference[i:i + 3].strip()), None)
        if stop is None:
            pytest.skip(f"the greedy text {reference!r} has no 3 visible characters to stop on")
        # No max_tokens to end it: only the abort the stop string causes does (or an
        # end-of-sequence token past the 24 the reference shows none in).
        text, outputs, processor = run_until_stop(engine, GenerationRequest(
            "stop", PROMPT, SamplingParams(temperature=0.0, max_tokens=10_000)), stop)
        assert stop not in text
        assert text == reference[:reference.index(stop)]
        assert processor.stop_sequence == stop
        final = outputs[-1]
        ran_past_reference = len(tokens_of(outputs)) >= 24
        assert final.finish_reason == "abort" or (ran_past_reference and final.finish_reason == "stop"), (
            f"the engine did not end the request the stop string aborted: {final}")
        after = run(engine, "after-stop", max_tokens=3)
        assert after[-1].finish_reason in ("stop", "length")

    def test_stop_token_ids_end_the_request(self, engine: Engine) -> None:
        reference = tokens_of(run(engine, "stop-id-ref", max_tokens=6))
        if len(reference) < 3:
            pytest.skip("the greedy completion is too short to stop in")
        outputs = run(engine, "stop-id", max_tokens=6, stop_token_ids=(reference[2],))
        assert outputs[-1].finish_reason == "stop"
        assert reference[2] not in tokens_of(outputs)[:2]
        assert len(tokens_of(outputs)) <= 3

    def test_seeded_sampling_is_reproducible(self, engine: Engine) -> None:
        first = tokens_of(run(engine, "seed-a", temperature=1.0, seed=1234, max_tokens=8))
        again = tokens_of(run(engine, "seed-b", temperature=1.0, seed=1234, max_tokens=8))
        assert first == again

    # -- cancellation ----------------------------------------------------------------------

    def test_closing_the_handle_aborts_and_the_engine_goes_on(self, engine: Engine) -> None:
        handle = engine.submit(GenerationRequest(
            "cancel", PROMPT, SamplingParams(temperature=0.0, max_tokens=10_000)))
        first = next(iter(handle))
        assert not first.finished or first.finish_reason in ("stop", "length")
        handle.close()
        after = run(engine, "after-cancel", max_tokens=3)
        assert after[-1].finish_reason in ("stop", "length")

    # -- memory ----------------------------------------------------------------------------

    def test_a_forward_gate_refusal_ends_only_that_request(self, engine: Engine) -> None:
        receiver = self.receiver(engine)
        gate = _RefuseOne("victim")
        receiver.set_forward_gate(gate)
        try:
            handles = [engine.submit(GenerationRequest(
                rid, fresh_prompt(salt), SamplingParams(temperature=0.0, max_tokens=4)))
                for salt, rid in ((7, "victim"), (11, "survivor"))]
            victim, survivor = (collect(h) for h in handles)
        finally:
            receiver.set_forward_gate(None)
        assert gate.asked >= 1, "the engine never asked its forward gate before a prefill"
        final = victim[-1]
        assert final.finish_reason == "error" and isinstance(final.rejected, RequestRejected)
        assert final.rejected.stage == "forward"
        assert not tokens_of(victim), "the refused request produced tokens"
        assert survivor[-1].finish_reason in ("stop", "length")


class ScriptedGate(ForwardGate):
    """A forward gate for engine tests: ``refuse(step)`` names request ids to refuse
    before the forward (each with a reason), ``after(step)`` after it; both default to
    refusing nothing."""

    def __init__(self, refuse=None, after=None):
        self._refuse = refuse or (lambda step: {})
        self._after = after or (lambda step: {})

    def check_prefill(self, step: PrefillStep) -> Refusals:
        return {rid: refusal(rid, reason) for rid, reason in self._refuse(step).items()}

    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        return {rid: refusal(rid, reason) for rid, reason in self._after(step).items()}


def refusal(request_id: str, reason: str) -> RequestRejected:
    """A forward-stage refusal whose message is ``reason``."""
    return RequestRejected(Rejection(estimated_bytes=0, limit_bytes=None, breakdown=None,
                                     request_id=request_id, stage="forward",
                                     cause="memory_short", detail=reason), retry_after_s=1.0)
