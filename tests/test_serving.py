"""The serving pipeline on a scripted engine: the order of the checks, the one place
max_tokens is settled, typed errors before the first output, keep-alives during a long
prefill, and what it reports to its events."""

from __future__ import annotations

import queue
from pathlib import Path
import threading
from typing import Any, Iterator, Mapping, Sequence

import pytest

from omlx_core.bootstrap import load_setup
from omlx_core.engine import (
    EngineLimits,
    GenerationOutput,
    GenerationRequest,
    GuardedEngine,
    MemoryHints,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from omlx_core.memory.types import Rejection, RequestRejected
from omlx_core.models.registry import ModelSpec
from omlx_core.server_context import ServerContext
from omlx_core.testing.detokenizer import TableDetokenizer
from omlx_core.serving import (
    EngineFailed,
    InvalidRequest,
    Job,
    ServingEvents,
    ServingPipeline,
    UnknownModel,
)

CONTEXT = 64
VOCAB = 100
#: what the scripted engine's tokens read as
TOKEN_TEXTS = {5: "a", 6: "b", 10: "Hel", 11: "lo, w", 12: "orld", 13: "!", 14: " And", 15: " more"}


class Handle(RequestHandle):
    """Outputs of a scripted request; closing it before the end aborts it like a real
    engine does: a final ``"abort"`` output, and nothing more of the script. The script
    makes its next output only when the reader asks for one (:attr:`wanted`), as an
    engine step follows the last: what the reader does with an output (a stop string's
    abort) happens before the next is made, whatever the threads' timing."""

    def __init__(self, engine: "ScriptedEngine", request_id: str):
        self.request_id = request_id
        self.engine = engine
        self.outputs: queue.Queue = queue.Queue()
        self.wanted = threading.Event()
        self.closed = False
        self.finished = False

    def __iter__(self) -> Iterator[GenerationOutput]:
        while (output := self.next_output(timeout=60)) is not None:
            yield output
            if output.finished:
                return

    def next_output(self, timeout: float | None = None) -> GenerationOutput | None:
        self.wanted.set()
        try:
            output = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        self.finished = output.finished
        return output

    def close(self) -> None:
        if not self.closed and not self.finished:
            self.engine.abort(self.request_id)
            self.outputs.put(GenerationOutput(self.request_id, finish_reason="abort"))
        self.closed = True


class ScriptedEngine(GuardedEngine):
    """Answers each request with ``script(request)``: its outputs, in order. A script that
    must hold an output until the test says so is a generator that waits on an event."""

    supported_sampling = frozenset({"logit_bias", "logprobs"})

    def __init__(self, script):
        self.model = ModelSpec(id="scripted", path=Path("."), engine="scripted", source="test")
        self.script = script
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def limits(self) -> EngineLimits:
        return EngineLimits(context_length=CONTEXT, vocab_size=VOCAB, max_running=4)

    def memory_hints(self) -> MemoryHints:
        return MemoryHints(prefill_step_size=16)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        return [1] * sum(len(m["content"].split()) for m in messages)

    def tokenize(self, text: str) -> list[int]:
        return [2] * len(text.split())

    def detokenizer(self) -> TableDetokenizer:
        return TableDetokenizer(TOKEN_TEXTS)

    def token_bytes(self, token_id: int) -> bytes:
        return TOKEN_TEXTS[token_id].encode()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        self.submitted.append(request)
        handle = Handle(self, request.request_id)

        def play() -> None:
            for output in self.script(request):
                if not handle.wanted.wait(60):
                    return  # the reader left without closing the handle
                handle.wanted.clear()
                if handle.closed:
                    return
                handle.outputs.put(output)

        threading.Thread(target=play, daemon=True).start()
        return handle

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def words(n: int) -> str:
    return " ".join(["w"] * n)


def completes(request: GenerationRequest):
    rid = request.request_id
    return [GenerationOutput(rid, token_ids=(5,)),
            GenerationOutput(rid, token_ids=(6,), finish_reason="length",
                             usage=Usage(len(request.prompt_tokens), 2))]


def rejected_in_forward(request_id: str) -> RequestRejected:
    return RequestRejected(Rejection(estimated_bytes=10, limit_bytes=5, breakdown=None,
                                     request_id=request_id, stage="forward",
                                     cause="memory_short", detail="no room"), retry_after_s=2.0)


class Recorder(ServingEvents):
    def __init__(self):
        self.admitted_: list[int] = []
        self.rejected_: list[str] = []

    def admitted(self, model_id: str, prompt_tokens: int, ttft_s: float) -> None:
        self.admitted_.append(prompt_tokens)

    def rejected(self, model_id: str, error: RequestRejected) -> None:
        self.rejected_.append(error.stage)


def pipeline_for(engine: ScriptedEngine, **settings: str) -> tuple[ServingPipeline, Recorder]:
    setup = load_setup("cpu-small", [], [(k, v, "test") for k, v in settings.items()])
    context = ServerContext(setup.config, setup.plugins, engines={"scripted": engine})
    events = Recorder()
    return ServingPipeline(context, events), events


def test_max_tokens_default_lives_in_the_configuration_and_fits_the_context() -> None:
    engine = ScriptedEngine(completes)
    pipeline, _ = pipeline_for(engine, **{"engine.max_tokens": "40"})
    pipeline.start(Job("scripted", SamplingParams(), text=words(10))).close()
    assert engine.submitted[-1].sampling.max_tokens == 40
    pipeline.start(Job("scripted", SamplingParams(), text=words(30))).close()
    assert engine.submitted[-1].sampling.max_tokens == CONTEXT - 30  # shortened, not refused
    with pytest.raises(InvalidRequest) as refused:
        pipeline.start(Job("scripted", SamplingParams(max_tokens=50), text=words(30)))
    assert refused.value.param == "max_tokens" and "at most 34" in refused.value.message
    pipeline.start(Job("scripted", SamplingParams(max_tokens=50), text=words(30),
                       max_tokens_is_cap=True)).close()
    assert engine.submitted[-1].sampling.max_tokens == 34
    with pytest.raises(InvalidRequest, match="over this model's 64-token context"):
        pipeline.start(Job("scripted", SamplingParams(), text=words(64)))


def test_requests_are_checked_against_what_the_engine_says_it_takes() -> None:
    engine = ScriptedEngine(completes)
    pipeline, _ = pipeline_for(engine)
    with pytest.raises(UnknownModel) as unknown:
        pipeline.start(Job("other", SamplingParams(), text="x"))
    assert "scripted" in unknown.value.message
    with pytest.raises(InvalidRequest) as unsupported:
        pipeline.start(Job("scripted", SamplingParams(presence_penalty=0.5), text="x"))
    assert unsupported.value.param == "presence_penalty"
    for sampling, param in ((SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
                            (SamplingParams(stop_token_ids=(VOCAB + 3,)), "stop_token_ids")):
        with pytest.raises(InvalidRequest) as outside:
            pipeline.start(Job("scripted", sampling, text="x"))
        assert outside.value.param == param
    with pytest.raises(InvalidRequest) as ids:
        pipeline.start(Job("scripted", SamplingParams(), token_ids=[3, VOCAB], prompt_param="prompt"))
    assert ids.value.param == "prompt"
    assert engine.submitted == []  # nothing refused here reached the engine


def test_a_forward_refusal_before_the_first_output_is_raised_typed_and_counted() -> None:
    def refuse(request):
        rejected = rejected_in_forward(request.request_id)
        return [GenerationOutput(request.request_id, finish_reason="error",
                                 error=str(rejected), rejected=rejected)]

    pipeline, events = pipeline_for(ScriptedEngine(refuse))
    with pytest.raises(RequestRejected) as refused:
        pipeline.start(Job("scripted", SamplingParams(), text="x y"))
    assert refused.value.stage == "forward" and refused.value.retry_after_s == 2.0
    assert events.rejected_ == ["forward"] and events.admitted_ == []
    assert len(pipeline.in_flight) == 0


def test_an_engine_failure_before_the_first_output_is_engine_failed() -> None:
    def fail(request):
        return [GenerationOutput(request.request_id, finish_reason="error", error="boom",
                                 error_type="internal")]

    pipeline, _ = pipeline_for(ScriptedEngine(fail))
    with pytest.raises(EngineFailed, match="the server log has the details") as failed:
        pipeline.start(Job("scripted", SamplingParams(), text="x"))
    # An internal failure's text is logged, not handed to the client.
    assert "boom" not in str(failed.value)


class HeldFirstToken:
    """A script whose first output waits until the test releases it (or 60 s pass, so a
    broken pipeline fails the test instead of hanging it)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.produced = threading.Event()

    def __call__(self, request: GenerationRequest) -> Iterator[GenerationOutput]:
        self.release.wait(60)
        self.produced.set()
        yield from completes(request)


def test_a_slow_first_token_starts_the_stream_with_keepalives() -> None:
    held = HeldFirstToken()
    pipeline, events = pipeline_for(ScriptedEngine(held))
    generation = pipeline.start(Job("scripted", SamplingParams(), text="x"), first_output_wait_s=0.1)
    assert not held.produced.is_set(), "start waited for the first token"
    deltas = []
    for delta in generation.deltas():
        deltas.append(delta)
        if sum(d.keepalive for d in deltas) == 2:
            held.release.set()
    keepalives = [d for d in deltas if d.keepalive]
    assert len(keepalives) >= 2 and not deltas[-1].keepalive
    assert "".join(d.text for d in deltas) == "ab" and generation.finish_reason == "length"
    assert events.admitted_ == [1]  # reported once, when the first output came
    generation.close()


def test_a_refusal_after_the_stream_started_is_an_in_band_failure() -> None:
    stream_started = threading.Event()

    def late_refusal(request):
        # Refused only once the client holds the stream's first keep-alive.
        assert stream_started.wait(60), "the stream never started"
        rejected = rejected_in_forward(request.request_id)
        yield GenerationOutput(request.request_id, finish_reason="error", error=str(rejected),
                               rejected=rejected)

    pipeline, events = pipeline_for(ScriptedEngine(late_refusal))
    generation = pipeline.start(Job("scripted", SamplingParams(), text="x"), first_output_wait_s=0.1)
    deltas = []
    for delta in generation.deltas():
        deltas.append(delta)
        stream_started.set()
    assert deltas and all(d.keepalive for d in deltas)
    assert generation.finish_reason == "error"
    assert isinstance(generation.failure, RequestRejected) and events.rejected_ == ["forward"]
    generation.close()


def test_a_long_prefill_keeps_the_http_stream_alive() -> None:
    """The status line and keep-alives reach the client while the engine still holds the
    first token (the test releases it only after two keep-alives arrived)."""
    import http.client
    import json

    from omlx_core.http.serve import HTTPServer

    held = HeldFirstToken()
    setup = load_setup("cpu-small", [], [("server.stream_keepalive_s", "0.1", "test")])
    context = ServerContext(setup.config, setup.plugins, engines={"scripted": ScriptedEngine(held)})
    with HTTPServer(context, host="127.0.0.1", port=0) as server:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
        connection.request("POST", "/v1/chat/completions", json.dumps({
            "model": "scripted", "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and not held.produced.is_set()
        keepalives = 0
        while keepalives < 2:
            line = response.readline()
            assert line, "the stream ended before two keep-alives"
            keepalives += line.startswith(b": keepalive")
        assert not held.produced.is_set()
        held.release.set()
        body = response.read().decode()
    assert '"content":"a"' in body and body.rstrip().endswith("data: [DONE]")


def test_the_http_server_has_a_thread_for_every_request_the_server_can_hold(caplog) -> None:
    from omlx_core.http.serve import SPARE_THREADS, thread_count

    setup = load_setup("cpu-small", [], [("memory.queue_size", "10", "test")])
    context = ServerContext(setup.config, setup.plugins,
                            engines={"a": ScriptedEngine(completes), "b": ScriptedEngine(completes)})
    assert setup.config["server.threads"] == "auto"
    needed = 2 * 4 + 10 + SPARE_THREADS  # two engines running 4 each, 10 queue places
    assert thread_count(context) == needed
    with caplog.at_level("WARNING"):
        assert thread_count(context, 8) == 8
    assert f"at least {needed}" in caplog.text


# -- stop strings: the pipeline's, never the engine's -------------------------------------


def says_hello_world(request: GenerationRequest):
    """"Hello, world! And more" in three outputs, the stop string "o, wor" split across
    tokens 11 and 12, and more tokens after it in the same output."""
    rid = request.request_id
    return [GenerationOutput(rid, token_ids=(10,), logprobs=(TokenLogprob(10, -0.1),)),
            GenerationOutput(rid, token_ids=(11, 12, 13, 14),
                             logprobs=tuple(TokenLogprob(t, -0.2) for t in (11, 12, 13, 14))),
            GenerationOutput(rid, token_ids=(15,), logprobs=(TokenLogprob(15, -0.3),),
                             finish_reason="length", usage=Usage(len(request.prompt_tokens), 6))]


def test_a_stop_string_split_across_tokens_ends_the_text_and_aborts_the_engine_request() -> None:
    engine = ScriptedEngine(says_hello_world)
    pipeline, _ = pipeline_for(engine)
    generation = pipeline.start(Job("scripted", SamplingParams(stop=("o, wor",), logprobs=0),
                                    text="x"))
    deltas = list(generation.deltas())
    assert "".join(d.text for d in deltas) == "Hell"
    assert generation.finish_reason == "stop" and generation.stop_sequence == "o, wor"
    # Logprobs only for tokens whose text the client got; none past the stop.
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [10, 11]
    assert [lp.bytes for d in deltas for lp in d.logprobs] == [b"Hel", b"lo, w"]
    # Every token up to the one that completed the stop string; none after it.
    assert generation.completion_tokens == 3
    request_id = engine.submitted[-1].request_id
    assert engine.aborted == [request_id], "the stop string did not abort the engine request"
    assert engine.submitted[-1].sampling.stop == (), "the engine was handed the stop strings"
    generation.close()
    assert engine.aborted == [request_id]


def test_a_stop_string_in_the_last_output_turns_length_into_stop() -> None:
    engine = ScriptedEngine(says_hello_world)
    pipeline, _ = pipeline_for(engine)
    generation = pipeline.start(Job("scripted", SamplingParams(stop=("more",)), text="x"))
    assert "".join(d.text for d in generation.deltas()) == "Hello, world! And "
    assert generation.finish_reason == "stop" and generation.stop_sequence == "more"
    assert engine.aborted == [], "a request that already ended needs no abort"
    generation.close()


def test_without_stop_strings_every_token_is_text() -> None:
    engine = ScriptedEngine(says_hello_world)
    pipeline, _ = pipeline_for(engine)
    generation = pipeline.start(Job("scripted", SamplingParams(), text="x"))
    assert "".join(d.text for d in generation.deltas()) == "Hello, world! And more"
    assert generation.finish_reason == "length" and generation.completion_tokens == 6
    generation.close()


def test_a_chat_request_carries_the_engines_cache_points_which_are_only_a_hint() -> None:
    """The pipeline asks the engine where a chat prompt's later requests are likely to
    part from it (``Engine.cache_points``) and hands that on with the request; an engine
    whose answer fails (a template that rejects a partial conversation) still serves it."""
    calls = []

    class Pointing(ScriptedEngine):
        def cache_points(self, messages, prompt_tokens, **kwargs):
            calls.append((len(messages), len(prompt_tokens)))
            if messages[-1]["content"] == "boom":
                raise ValueError("the template rejects an empty message")
            return (1, 3)

    engine = Pointing(completes)
    pipeline, _ = pipeline_for(engine)
    messages = [{"role": "system", "content": "a b"}, {"role": "user", "content": "c d e"}]
    pipeline.start(Job("scripted", SamplingParams(), messages=messages)).close()
    assert engine.submitted[-1].cache_points == (1, 3) and calls == [(2, 5)]
    pipeline.start(Job("scripted", SamplingParams(), messages=messages[:1] + [
        {"role": "user", "content": "boom"}])).close()
    assert engine.submitted[-1].cache_points == ()
    pipeline.start(Job("scripted", SamplingParams(), text="a b c")).close()
    assert engine.submitted[-1].cache_points == () and len(calls) == 2  # not asked for text
