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

It checks, on the engine object itself (no server):

- outputs: token ids streamed as they come, ``max_tokens`` never exceeded (the check
  fails as soon as one token too many arrives), stop token ids end the request with
  ``"stop"`` before the stop token, usage counts what was streamed;
- sampling, as a distribution (:mod:`omlx_core.testing.sampling_check`): a few hundred
  seeded one-token requests are compared with the model's own next-token probabilities
  (an independent forward, :meth:`EngineConformance.reference`) at a temperature where
  greedy or unscaled sampling is told apart, and at temperature 1 with ``top_k``,
  ``top_p`` and ``min_p``: no token outside what they keep, frequencies within an exact
  binomial bound. A correct engine fails one of these checks with probability at most
  1e-6 over the choice of seeds; the seeds are fixed, so the outcome is the same on
  every run;
- seeds: a seed gives the same tokens again, and two seeds give different ones;
- cancellation: ``abort`` ends a running request with ``"abort"`` within
  :data:`~omlx_core.testing.engine_io.AFTER_ABORT_TOKENS` tokens, also before its
  first token, closing the handle does the same, and the engine then holds nothing of
  it (its ``progress()`` and ``stats()`` running and queued counts);
- stop strings: the engine's ``detokenizer()`` serves the pipeline's output processor,
  the stop string is cut where the pipeline cuts it, and the abort it causes ends the
  request within the same bound;
- logprobs (when the engine lists them in ``supported_sampling``): the chosen token's
  and the top ones, equal to the reference's;
- memory: the limits and memory hints, every prefill forward asked of the forward gate
  in chunks no larger than the hinted prefill step and covering the prompt, and a
  gate refusal ending only the refused request. The gate is installed on the object
  the real ``resolve_scheduler`` hook finds for the engine (the installed plugins
  answer), so a receiver that is never reached fails here rather than in production.

Every wait on the engine is bounded (:data:`~omlx_core.testing.engine_io.TIMEOUT_S`).
An engine whose models mlx-lm cannot load sets
:attr:`EngineConformance.reference_forward`.
"""

from __future__ import annotations

import random
from typing import Iterator

import pytest

from omlx_core.engine import (
    Engine,
    GenerationRequest,
    GuardedEngine,
    SamplingParams,
)
from omlx_core.memory.gate import (ForwardGate, MemoryReceiver, PrefillStep, Refusals,
                                   refusal_waits)
from omlx_core.memory.types import Rejection, RequestRejected
from omlx_core.testing import sampling_check
from omlx_core.testing.engine_io import (
    AFTER_ABORT_TOKENS,
    ENDLESS,
    PROMPT,
    TIMEOUT_S,
    abort_after_first_output,
    collect,
    first_tokens,
    fresh_prompt,
    run,
    run_until_stop,
    text_of,
    tokens_of,
)
from omlx_core.testing.sampling_check import Reference, frequency_failures
from omlx_core.testing.waiting import wait_for

__all__ = [
    "AFTER_ABORT_TOKENS", "EngineConformance", "PROMPT", "ScriptedGate", "TIMEOUT_S", "collect",
    "fresh_prompt", "refusal", "run", "run_until_stop", "text_of", "tokens_of",
]

#: one-token requests per distribution check, and per top-k / top-p / min-p check
SAMPLES = 200
FILTER_SAMPLES = 100
#: the first seed of the sampling checks (each check uses its own range of seeds)
SEED_BASE = 7_000

_REFERENCES: dict[tuple[str, str, tuple[int, ...]], Reference] = {}


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


class _Recording(ForwardGate):
    """A gate that refuses nothing and keeps every step it was asked about."""

    def __init__(self) -> None:
        self.steps: list[PrefillStep] = []

    def check_prefill(self, step: PrefillStep) -> Refusals:
        self.steps.append(step)
        return {}

    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        return {}


def _seeds(check: int, count: int) -> list[int]:
    return list(range(SEED_BASE + 1_000 * check, SEED_BASE + 1_000 * check + count))


def _held(engine: Engine, request_id: str) -> str | None:
    """What the engine still holds of ``request_id`` (``None``: nothing)."""
    if any(p.request_id == request_id for p in engine.progress()):
        return f"progress() still lists {request_id!r}"
    stats = engine.stats()
    busy = {k: stats[k] for k in ("running", "queue_depth") if stats.get(k)}
    return f"stats() says {busy}" if busy else None


def assert_released(engine: Engine, request_id: str) -> None:
    """The engine lets go of an ended request (a bounded wait: it may finish a step)."""
    assert wait_for(lambda: _held(engine, request_id) is None, TIMEOUT_S), (
        f"{TIMEOUT_S:.0f} s after request {request_id!r} ended, {_held(engine, request_id)}")


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

    #: the model's own forward for :meth:`reference`, run on the engine's MLX thread as
    #: ``reference_forward(model_path, prompt)``: mlx-lm's by default; an engine on
    #: mlx-vlm models sets :func:`~omlx_core.testing.sampling_check.mlx_vlm_reference`
    reference_forward = staticmethod(sampling_check.mlx_lm_reference)

    def reference(self, engine: Engine, prompt: list[int]) -> Reference:
        """The model's next-token log-probabilities after ``prompt``, computed without the
        engine (:attr:`reference_forward`, once per model and prompt)."""
        forward = self.reference_forward
        key = (forward.__qualname__, str(engine.model.path), tuple(prompt))
        if key not in _REFERENCES:
            _REFERENCES[key] = engine.host.thread.submit(
                forward, engine.model.path, prompt).result(TIMEOUT_S)
        return _REFERENCES[key]

    def _check_sampling(self, engine: Engine, check: int, count: int, **sampling: float) -> None:
        reference = self.reference(engine, PROMPT)
        expected = sampling_check.category_probs(
            sampling_check.filtered(reference.logprobs, **sampling), reference.end_ids)
        drawn = first_tokens(engine, f"sample-{check}", _seeds(check, count), **sampling)
        failures = frequency_failures(drawn, expected)
        assert not failures, (f"{count} draws with {sampling} do not follow the model's "
                              f"distribution: " + "; ".join(failures))

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
        # A stop token is counted but not streamed.
        assert final.usage.completion_tokens - generated == (final.finish_reason == "stop"), (
            f"usage counts {final.usage.completion_tokens} tokens, {generated} were streamed "
            f"and the request ended {final.finish_reason!r}")
        if generated >= 2:
            assert len(outputs) >= 2, "every token arrived in one output: nothing was streamed"

    @pytest.mark.parametrize("max_tokens", [1, 5])
    def test_max_tokens_is_never_exceeded(self, engine: Engine, max_tokens: int) -> None:
        outputs = run(engine, f"max-{max_tokens}", max_tokens=max_tokens)  # fails past it
        final = outputs[-1]
        assert final.finish_reason in ("stop", "length"), final
        assert final.usage is not None and final.usage.completion_tokens <= max_tokens
        if final.finish_reason == "length":
            assert len(tokens_of(outputs)) == final.usage.completion_tokens == max_tokens

    def test_a_stop_string_is_cut_by_the_pipeline_and_aborts_the_request(self, engine: Engine) -> None:
        reference = text_of(engine, run(engine, "stop-ref", max_tokens=24))
        stop = next((reference[i:i + 3] for i in range(2, len(reference) - 3)
                     if reference[i:i + 3].strip()), None)
        if stop is None:
            pytest.skip(f"the greedy text {reference!r} has no 3 visible characters to stop on")
        # No max_tokens to end it: only the abort the stop string causes does (or an
        # end-of-sequence token past the 24 the reference shows none in).
        text, outputs, processor = run_until_stop(engine, GenerationRequest(
            "stop", PROMPT, SamplingParams(temperature=0.0, max_tokens=ENDLESS)), stop)
        assert stop not in text
        assert text == reference[:reference.index(stop)]
        assert processor.stop_sequence == stop
        final = outputs[-1]
        ran_past_reference = len(tokens_of(outputs)) >= 24
        assert final.finish_reason == "abort" or (ran_past_reference and final.finish_reason == "stop"), (
            f"the engine did not end the request the stop string aborted: {final}")
        assert_released(engine, "stop")
        after = run(engine, "after-stop", max_tokens=3)
        assert after[-1].finish_reason in ("stop", "length")

    def test_stop_token_ids_end_the_request(self, engine: Engine) -> None:
        reference = tokens_of(run(engine, "stop-id-ref", max_tokens=6))
        if len(reference) < 3:
            pytest.skip("the greedy completion is too short to stop in")
        stop_id = reference[2]
        ends_at = reference.index(stop_id)
        outputs = run(engine, "stop-id", max_tokens=6, stop_token_ids=(stop_id,))
        final = outputs[-1]
        assert final.finish_reason == "stop", f"stop_token_ids={[stop_id]} did not end it: {final}"
        assert tokens_of(outputs) == reference[:ends_at], "the stop token or tokens past it streamed"
        assert final.usage is not None and final.usage.completion_tokens == ends_at + 1

    def test_logprobs_are_the_models(self, engine: Engine) -> None:
        if "logprobs" not in engine.supported_sampling:
            pytest.skip("the engine does not honour logprobs (the pipeline refuses them)")
        reference = self.reference(engine, PROMPT).logprobs
        outputs = run(engine, "logprobs", max_tokens=3, logprobs=5)
        entries = [entry for o in outputs for entry in (o.logprobs or ())]
        assert [e.token_id for e in entries] == tokens_of(outputs), (
            "one logprob entry per streamed token, in order")
        first = entries[0]
        fifth = float(sorted(reference)[-5])
        assert len(first.top) == 5
        for token, logprob in ((first.token_id, first.logprob), *first.top):
            assert abs(logprob - reference[token]) < 1e-3, (
                f"token {token}: logprob {logprob:.5f}, the model's {reference[token]:.5f}")
            if (token, logprob) != (first.token_id, first.logprob):
                assert reference[token] >= fifth - 1e-3, f"token {token} is not among the top 5"
        for entry in entries:
            values = [lp for _, lp in entry.top]
            assert values == sorted(values, reverse=True) and entry.logprob <= 0.0
            assert entry.top[0][0] == entry.token_id, "greedy: the chosen token is the likeliest"

    # -- sampling --------------------------------------------------------------------------

    def test_sampling_follows_the_models_distribution(self, engine: Engine) -> None:
        """Seeded draws at a temperature where the likeliest token has about a third of
        the mass: greedy decoding, an ignored temperature or a fixed key all fail."""
        temperature = sampling_check.temperature_for(self.reference(engine, PROMPT).logprobs)
        self._check_sampling(engine, 0, SAMPLES, temperature=temperature)

    def test_top_k_is_honoured(self, engine: Engine) -> None:
        top_k = sampling_check.top_k_for(self.reference(engine, PROMPT).logprobs)
        self._check_sampling(engine, 1, FILTER_SAMPLES, temperature=1.0, top_k=top_k)

    def test_top_p_is_honoured(self, engine: Engine) -> None:
        top_p = sampling_check.top_p_for(self.reference(engine, PROMPT).logprobs)
        self._check_sampling(engine, 2, FILTER_SAMPLES, temperature=1.0, top_p=top_p)

    def test_min_p_is_honoured(self, engine: Engine) -> None:
        min_p = sampling_check.min_p_for(self.reference(engine, PROMPT).logprobs)
        self._check_sampling(engine, 3, FILTER_SAMPLES, temperature=1.0, min_p=min_p)

    def test_a_seed_fixes_the_tokens_and_another_seed_changes_them(self, engine: Engine) -> None:
        first = tokens_of(run(engine, "seed-a", temperature=1.0, seed=1234))
        again = tokens_of(run(engine, "seed-b", temperature=1.0, seed=1234))
        other = tokens_of(run(engine, "seed-c", temperature=1.0, seed=4321))
        assert first == again, "the same seed gave different tokens"
        assert first != other, "two seeds gave the same 8 tokens at temperature 1"

    # -- cancellation ----------------------------------------------------------------------

    def test_abort_ends_a_running_request_within_a_few_tokens(self, engine: Engine) -> None:
        outputs, _ = abort_after_first_output(engine, "abort")  # fails past the bound
        final = outputs[-1]
        assert final.finish_reason == "abort", f"abort() did not end the request: {final}"
        assert_released(engine, "abort")

    def test_abort_before_the_first_token_ends_the_request(self, engine: Engine) -> None:
        handle = engine.submit(GenerationRequest(
            "abort-early", fresh_prompt(9), SamplingParams(temperature=0.0, max_tokens=ENDLESS)))
        engine.abort("abort-early")
        outputs = collect(handle, max_tokens=AFTER_ABORT_TOKENS)
        assert outputs[-1].finish_reason == "abort", outputs[-1]
        assert_released(engine, "abort-early")

    def test_closing_the_handle_aborts_and_the_engine_goes_on(self, engine: Engine) -> None:
        outputs, _ = abort_after_first_output(engine, "cancel", close=True)
        assert outputs[-1].finish_reason == "abort", f"closing the handle did not end it: {outputs[-1]}"
        assert_released(engine, "cancel")
        after = run(engine, "after-cancel", max_tokens=3)
        assert after[-1].finish_reason in ("stop", "length")

    # -- memory ----------------------------------------------------------------------------

    def test_prefill_chunks_keep_to_the_memory_hints(self, engine: Engine) -> None:
        """The gate is asked before every prefill forward, for chunks no larger than the
        hinted prefill step (what the estimate assumed), covering the whole prompt."""
        step = engine.memory_hints().prefill_step_size
        context = engine.limits().context_length or 4 * step
        length = max(len(PROMPT), min(step + 8, context - 16, 4_096))
        draw = random.Random(length)
        prompt = [draw.randrange(20, min(engine.limits().vocab_size, 500)) for _ in range(length)]
        receiver = self.receiver(engine)
        gate = _Recording()
        receiver.set_forward_gate(gate)
        try:
            outputs = run(engine, "hinted", prompt, max_tokens=2)
        finally:
            receiver.set_forward_gate(None)
        assert outputs[-1].finish_reason in ("stop", "length")
        chunks = [c for s in gate.steps for c in s.chunks if c.request_id == "hinted"]
        assert chunks, "the engine never asked its forward gate before a prefill"
        assert max(c.new_tokens for c in chunks) <= step, (
            f"a prefill chunk of {max(c.new_tokens for c in chunks)} tokens; the memory hints "
            f"say {step}")
        assert max(c.cached_tokens + c.new_tokens for c in chunks) >= length - 1, (
            "the gate was not asked about every prefilled token")
        if length - 1 > step:
            assert len(chunks) >= 2

    def test_a_forward_gate_refusal_ends_only_that_request(self, engine: Engine) -> None:
        receiver = self.receiver(engine)
        gate = _RefuseOne("victim")
        receiver.set_forward_gate(gate)
        try:
            handles = [engine.submit(GenerationRequest(
                rid, fresh_prompt(salt), SamplingParams(temperature=0.0, max_tokens=4)))
                for salt, rid in ((7, "victim"), (11, "survivor"))]
            victim, survivor = (collect(h, max_tokens=4) for h in handles)
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
        # Which refused requests wait follows the contract (refusal_waits), as a
        # memory guard's gate does.
        refused = self._refuse(step)
        return {rid: refusal(rid, reason, wait=refusal_waits(step.running, len(refused), index))
                for index, (rid, reason) in enumerate(refused.items())}

    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        return {rid: refusal(rid, reason) for rid, reason in self._after(step).items()}


def refusal(request_id: str, reason: str, *, wait: bool = False) -> RequestRejected:
    """A forward-stage refusal whose message is ``reason``."""
    return RequestRejected(Rejection(estimated_bytes=0, limit_bytes=None, breakdown=None,
                                     request_id=request_id, stage="forward",
                                     cause="memory_short", detail=reason), retry_after_s=1.0,
                           wait=wait)
