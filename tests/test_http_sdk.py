"""The official ``openai`` and ``anthropic`` SDKs against a real waitress server on
loopback serving the real default model (SmolLM2-135M-Instruct): answers, streaming,
refusals before the first byte (413 on an oversized prompt), in-band errors after it,
client hang-ups, API keys, and ``omlx-core serve`` itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Iterator

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.http import HTTPServer, build_frontend
from omlx_core.server_context import ServerContext
from omlx_core.testing.waiting import free_port, wait_for, wait_for_output

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def start_default(**settings: str) -> ServerContext:
    overrides = [(key.replace("__", "."), value, "test") for key, value in settings.items()]
    setup = load_setup("cpu-small", [], overrides)
    return start_engines(setup, progress=False)


@pytest.fixture(scope="module")
def context(default_model_dir) -> Iterator[ServerContext]:
    context = start_default()
    yield context
    stop_engines(context)


@pytest.fixture
def client(server: HTTPServer):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(server: HTTPServer):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


def idle(context: ServerContext) -> bool:
    stats = context.engines[MODEL].stats()
    return stats["running"] == 0 and stats["prefilling"] == 0 and stats["queue_depth"] == 0


# -- answers -----------------------------------------------------------------------------------


def test_openai_chat_non_streaming(client) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                max_tokens=24)
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 5 and completion.usage.completion_tokens > 0


def test_openai_chat_streaming_with_usage(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_openai_completions_with_stop(client) -> None:
    completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                           temperature=0, max_tokens=32, stop=["."])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and "." not in choice.text and choice.text.strip()
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=32,
        stop=["."], stream=True) if c.choices)
    assert streamed == choice.text


def test_openai_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=2)
    assert raised.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-nothing", messages=QUESTION)
    assert raised.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=7)


def test_anthropic_messages(claude) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION,
                                     extra_body={"temperature": 0})
    assert message.content[0].type == "text" and "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    # This SDK version no longer has a temperature argument; the server still takes it.
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=QUESTION,
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nothing", max_tokens=4, messages=QUESTION)


# -- after the first byte ----------------------------------------------------------------------


def test_sdk_hang_up_mid_stream_aborts_the_request(context, server, client) -> None:
    engine = context.engines[MODEL]
    aborted = engine.stats()["finished"]["abort"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_tokens=2000, stream=True, temperature=0)
    for _, _chunk in zip(range(3), stream):
        pass
    assert engine.stats()["running"] == 1
    stream.close()
    assert wait_for(lambda: idle(context), timeout=60), engine.stats()
    assert engine.stats()["finished"]["abort"] == aborted + 1
    assert wait_for(lambda: len(server.frontend.pipeline.in_flight) == 0)


def test_errors_after_the_first_byte_reach_both_sdks(context) -> None:
    story = [{"role": "user", "content": "Write a long story about a cat."}]
    with HTTPServer(context, port=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=story, max_tokens=2000,
                                                stream=True)
        next(iter(stream))
        server.frontend.pipeline.in_flight.abort_all()
        with pytest.raises(openai.APIError, match="aborted"):
            for _chunk in stream:
                pass
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with claude.messages.stream(model=MODEL, max_tokens=2000, messages=story) as events:
            next(iter(events))
            server.frontend.pipeline.in_flight.abort_all()
            with pytest.raises(anthropic.APIError, match="aborted"):
                for _event in events:
                    pass
    assert wait_for(lambda: idle(context))


# -- API keys ---------------------------------------------------------------------------------


def test_api_keys_with_both_sdks(context) -> None:
    frontend = build_frontend(context, api_keys=["sk-right"])
    with HTTPServer(context, port=0, frontend=frontend) as server:
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-right", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good_claude = anthropic.Anthropic(base_url=server.url, api_key="sk-right", max_retries=0)
        message = good_claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert message.usage.output_tokens >= 1
        bad_claude = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad_claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)


# -- an oversized prompt: 413 before any byte of a stream ------------------------------------------


# ~100k tokens: its KV alone is several GiB, whatever else the process holds.
LONG_PROMPT = [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps. " * 16_000}]
CEILING = 4 * 1024**3


@pytest.fixture(scope="module")
def guarded(context: ServerContext) -> Iterator[ServerContext]:
    """The default model under a pinned 4 GiB ceiling, with a context long enough that only
    memory can refuse the long prompt."""
    guarded = start_default(memory__tier="custom", memory__custom_ceiling=str(CEILING),
                            engine__max_context="200000")
    guard, engine = guarded.memory_guard, guarded.engines[MODEL]
    assert wait_for(lambda: guard.snapshot is not None)
    baseline = guard.snapshot.baseline_bytes
    short = guard.estimate(guard.peak_query(engine, engine.tokenize_chat(QUESTION))).total
    long = guard.estimate(guard.peak_query(engine, engine.tokenize_chat(LONG_PROMPT))).total
    assert baseline + short < CEILING < long, (baseline, short, long)
    yield guarded
    stop_engines(guarded)


def test_oversized_prompt_is_413_through_both_sdks(guarded: ServerContext) -> None:
    engine = guarded.engines[MODEL]
    before = engine.stats()
    with HTTPServer(guarded, port=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as raised:
                client.chat.completions.create(model=MODEL, messages=LONG_PROMPT, max_tokens=8,
                                               stream=stream)
            error = raised.value
            assert error.status_code == 413
            assert error.response.headers["content-type"].startswith("application/json")
            body = error.body
            assert body["code"] == "prefill_memory_exceeded"
            assert body["binding_ceiling"] == "custom"
            assert body["estimated_bytes"] > 0 and body["limit_bytes"] > 0
            assert isinstance(body["advice"], list)
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(anthropic.APIStatusError) as raised:
                claude.messages.create(model=MODEL, max_tokens=8, messages=LONG_PROMPT,
                                       stream=stream)
            assert raised.value.status_code == 413
            assert raised.value.body["error"]["code"] == "prefill_memory_exceeded"
        # The short prompt still runs under the same ceiling.
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                                temperature=0)
        assert "Paris" in answer.choices[0].message.content
    after = engine.stats()
    # The refused requests never reached the engine: only the short one was prefilled.
    assert after["finished"]["error"] == before["finished"]["error"]
    assert after["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"] < 200


# -- omlx-core serve ----------------------------------------------------------------------------


def test_omlx_core_serve_prints_ready_and_stops_on_sigterm(default_model_dir, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "omlx_core", "serve", "--tier", "cpu-small", "--port", str(port)],
            stdout=output, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_for_output(process, log, f"omlx-core ready: http://127.0.0.1:{port}", timeout=120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        # The default chat model, and the shipped embedding model served beside it.
        assert [m.id for m in client.models.list().data] == [MODEL, "all-minilm-l6-v2"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
