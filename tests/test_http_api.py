"""The HTTP front end on a real waitress server over loopback, with the built-in batched
engine serving a tiny random-weight llama: protocol shapes, SSE framing, every refusal
before the first byte, in-band errors after it, disconnect aborts, and a schema-driven
fuzz run that must never produce a 5xx."""

from __future__ import annotations

import dataclasses
import gc
import http.client
import json
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.config import Sourced
from omlx_core.http import HTTPServer, build_frontend, serve_forever
from omlx_core.memory.gate import PrefillStep
from omlx_core.memory.usage import MemoryUsage, footprint_bytes
from omlx_core.server_context import ServerContext
from omlx_core.testing import SPECIAL_TOKENS, cached_model, special_token_id
from omlx_core.testing.waiting import wait_for

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Say something."}]


# -- set-up ------------------------------------------------------------------------------


def start_context(tmp_path: Path, model_dir: Path, **settings: str) -> ServerContext:
    """Engines for ``model_dir`` served as ``tiny``, through the real bootstrap."""
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["{MODEL}"]\n\n[models.{MODEL}]\npath = "{model_dir}"\n'
                      'engine = "batched"\n')
    overrides = [(key.replace("__", "."), value, "test") for key, value in settings.items()]
    setup = load_setup("cpu-small", [config], overrides)
    return start_engines(setup, progress=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerContext]:
    context = start_context(tmp_path_factory.mktemp("config"), tiny_dir, server__max_body="64KiB")
    yield context
    stop_engines(context)


def request(server: HTTPServer, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None, raw: bytes | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        sent = {"Content-Type": "application/json"} if payload is not None else {}
        sent.update(headers or {})
        connection.request(method, path, body=payload, headers=sent)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def post(server: HTTPServer, path: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
    status, headers, data = request(server, "POST", path, body, **kwargs)
    if headers.get("content-type", "").startswith("application/json"):
        return status, headers, json.loads(data)
    return status, headers, data


def sse_events(data: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event, checking the framing as it goes."""
    text = data.decode("utf-8")
    assert text.endswith("\n\n"), "a stream must end with a complete event"
    events = []
    for block in text[:-2].split("\n\n"):
        name, payload = None, None
        for line in block.split("\n"):
            field, sep, value = line.partition(": ")
            assert sep, f"malformed SSE line {line!r}"
            if field == "event":
                name = value
            else:
                assert field == "data", f"unexpected SSE field {field!r}"
                payload = value
        assert payload is not None, f"event without data: {block!r}"
        events.append((name, payload))
    return events


def engine_idle(context: ServerContext) -> bool:
    engine = context.engines.get(MODEL)
    if engine is None:  # unloaded (the fuzz sends the pool's admin actions too)
        return True
    stats = engine.stats()
    return stats["running"] == 0 and stats["prefilling"] == 0 and stats["queue_depth"] == 0


# -- OpenAI chat and text completions ------------------------------------------------------


def test_chat_completion_non_streaming(server: HTTPServer) -> None:
    status, headers, body = post(server, "/v1/chat/completions",
                                 {"model": MODEL, "messages": CHAT, "max_tokens": 6,
                                  "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 6 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_stream_framing_and_include_usage(server: HTTPServer) -> None:
    status, headers, data = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(payload) for _, payload in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # With include_usage every chunk has "usage": null, and one last chunk carries it.
    assert all("usage" in c for c in chunks)
    *content, finish, usage_chunk = chunks
    assert all(c["usage"] is None for c in content + [finish])
    assert finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] <= 5
    assert usage_chunk["usage"]["completion_tokens"] >= 1


def test_stream_without_include_usage_has_no_usage(server: HTTPServer) -> None:
    status, _, data = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True})
    assert status == 200
    chunks = [json.loads(p) for _, p in sse_events(data)[:-1]]
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)


def greedy_text(server: HTTPServer, **extra: Any) -> tuple[str, str]:
    status, _, body = post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
        **extra})
    assert status == 200, body
    return body["choices"][0]["text"], body["choices"][0]["finish_reason"]


def test_stop_string_ends_the_completion_before_it(server: HTTPServer) -> None:
    full, _ = greedy_text(server)
    assert len(full) >= 8, "the tiny model should produce some text"
    stop = full[4:7]
    cut = full.index(stop)
    text, reason = greedy_text(server, stop=[stop])
    assert (text, reason) == (full[:cut], "stop")
    status, _, data = post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
        "stop": stop, "stream": True})
    chunks = [json.loads(p) for _, p in sse_events(data)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_split_across_tokens_never_lets_later_tokens_out(context, server) -> None:
    """The pipeline cuts the text at a stop string that spans two tokens, sends nothing
    of it or after it (text, logprobs, usage), and aborts the engine request."""
    prompt = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    status, _, body = post(server, "/v1/completions", {**prompt, "logprobs": 0})
    assert status == 200, body
    full, tokens = body["choices"][0]["text"], body["choices"][0]["logprobs"]["tokens"]
    # Token ``split`` has text before the stop string (so its logprob is sent), token
    # ``split + 1`` completes it (counted, not sent).
    split = next((i for i in range(1, len(tokens) - 1)
                  if len(tokens[i].strip()) >= 2 and tokens[i + 1].strip()
                  and (tokens[i] + tokens[i + 1]).isascii() and (tokens[i] + tokens[i + 1]).isprintable()
                  and full.find(tokens[i][-1] + tokens[i + 1][0])
                  == len("".join(tokens[:i + 1]).lstrip()) - 1), None)
    assert split is not None, f"no two visible tokens to split a stop string across in {tokens}"
    stop = tokens[split][-1] + tokens[split + 1][0]
    cut = full.index(stop)
    finished = context.engines[MODEL].scheduler.counters.finished
    # Only the abort can end these: no length within reach, no end-of-sequence token
    # (the greedy tokens before the stop are the same: none of them was one).
    endless = {**prompt, "max_tokens": 2000,
               "logit_bias": {str(special_token_id(t)): -100 for t in SPECIAL_TOKENS}}

    aborted = finished["abort"]
    status, _, body = post(server, "/v1/completions", {**endless, "logprobs": 0, "stop": [stop]})
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (full[:cut], "stop")
    assert choice["logprobs"]["tokens"] == tokens[:split + 1]
    assert body["usage"]["completion_tokens"] == split + 2
    assert finished["abort"] == aborted + 1, "the stop string did not abort the engine request"

    aborted = finished["abort"]
    status, _, data = post(server, "/v1/completions", {
        **endless, "logprobs": 0, "stop": stop, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(p) for _, p in sse_events(data)[:-1]]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in streamed) == full[:cut]
    assert [t for c in streamed if c.get("logprobs") for t in c["logprobs"]["tokens"]] == tokens[:split + 1]
    assert streamed[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == split + 2
    assert finished["abort"] == aborted + 1, "the stop string did not abort the engine request"
    assert engine_idle(context)


def test_logprobs_in_both_shapes(server: HTTPServer) -> None:
    status, _, body = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
        # Seeded: the tiny model's sampled tokens are the same every run. (Unseeded, one
        # run in a few drew the byte-0 token, whose text mlx-lm's streaming detokenizer
        # gives as "Ā" where its bytes are b"\x00": left open, noted in the issue.)
        "seed": 3})
    assert status == 200, body
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"]
    for entry in entries:
        assert entry["logprob"] <= 0 and isinstance(entry["bytes"], list)
        assert len(entry["top_logprobs"]) == 2
    # The tokens' bytes spell the content, even where a token is half a character (the
    # detokenizer drops the leading space of a completion).
    spelled = b"".join(bytes(entry["bytes"]) for entry in entries).decode("utf-8", "replace")
    assert spelled.lstrip() == body["choices"][0]["message"]["content"].lstrip()
    status, _, body = post(server, "/v1/completions", {
        "model": MODEL, "prompt": "abc", "max_tokens": 4, "logprobs": 1})
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"])
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) == 1 for top in logprobs["top_logprobs"])


def test_completion_with_token_id_prompt(server: HTTPServer) -> None:
    status, _, body = post(server, "/v1/completions",
                           {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 4


def test_models_health_and_openapi(server: HTTPServer) -> None:
    status, _, data = request(server, "GET", "/v1/models")
    listed = {m["id"]: m for m in json.loads(data)["data"]}
    # The served model is resident and pinned; the tier's other entries are available.
    assert status == 200 and listed[MODEL]["state"] == "resident" and listed[MODEL]["pinned"]
    assert listed[MODEL]["object"] == "model" and listed[MODEL]["engine"] == "batched"
    assert listed[MODEL]["resident_bytes"] > 0 and listed[MODEL]["context_length"] > 0
    assert {m["state"] for i, m in listed.items() if i != MODEL} <= {"available"}
    status, _, data = request(server, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(data)["id"] == MODEL
    status, _, data = request(server, "GET", "/health")
    health = json.loads(data)
    assert status == 200 and health["status"] == "ok"
    assert health["pool"]["models"][MODEL]["state"] == "resident"
    status, _, data = request(server, "GET", "/openapi.json")
    document = json.loads(data)
    assert document["openapi"].startswith("3.")
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["n"]["maximum"] == 1
    assert "/v1/messages" in document["paths"]


# -- Anthropic Messages ----------------------------------------------------------------------


def test_messages_non_streaming_and_streaming(server: HTTPServer) -> None:
    body = {"model": MODEL, "max_tokens": 5, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    status, _, message = post(server, "/v1/messages", body)
    assert status == 200, message
    assert message["type"] == "message" and message["content"][0]["type"] == "text"
    assert message["stop_reason"] in ("end_turn", "max_tokens")
    assert message["usage"]["output_tokens"] <= 5
    status, headers, data = post(server, "/v1/messages", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(json.loads(payload)["type"] == name for name, payload in events)


# -- refusals before the first byte -------------------------------------------------------


def error_of(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    return body["error"]


@pytest.mark.parametrize("body, param, fragment", [
    ({"messages": CHAT}, "model", "missing required parameter 'model'"),
    ({"model": MODEL}, "messages", "missing required parameter 'messages'"),
    ({"model": MODEL, "messages": []}, "messages", "must not be empty"),
    ({"model": MODEL, "messages": CHAT, "n": 2}, "n", "only n=1 is supported"),
    ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature", "must be a number"),
    ({"model": MODEL, "messages": CHAT, "temperature": 1e308}, "temperature", "at most 2"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 10**30}, "max_tokens", "at most"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content", "missing"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0].type", "content parts must be text or image_url"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url", "image_url.url is missing"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     "messages[0].content[0]", "takes text only"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "text part needs its text"),
    ({"model": MODEL, "messages": CHAT, "tools": []}, "tools", "must not be empty"),
    ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters",
     "of type \"object\""),
    ({"model": MODEL, "messages": CHAT, "stop": ["a"] * 17}, "stop", "at most 16"),
    ({"model": MODEL, "messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias.abc", "token ids"),
    ({"model": MODEL, "messages": CHAT, "logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary"),
    ({"model": MODEL, "messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}},
     "stream_options", "only allowed when stream is true"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 100000}, "max_tokens", "does not fit"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]}, "messages",
     "context"),
])
def test_invalid_chat_requests_are_400_naming_the_parameter(server, body, param, fragment) -> None:
    status, _, response = post(server, "/v1/chat/completions", body)
    assert status == 400, response
    error = error_of(response)
    assert error["param"] == param and fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(server: HTTPServer) -> None:
    status, _, body = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x", "extra": 1}],
        "max_tokens": 2, "user": "u1", "metadata": {"a": "b"}, "some_future_field": [1, 2]})
    assert status == 200, body


def test_n_greater_than_one_is_a_clear_400_on_completions(server: HTTPServer) -> None:
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "n": 3})
    assert status == 400 and error_of(body)["param"] == "n"


def test_unknown_model_is_404_in_each_api_shape(server: HTTPServer) -> None:
    status, _, body = post(server, "/v1/chat/completions", {"model": "nope", "messages": CHAT})
    assert status == 404 and error_of(body)["code"] == "model_not_found"
    assert MODEL in error_of(body)["message"]
    status, _, body = post(server, "/v1/messages",
                           {"model": "nope", "max_tokens": 4, "messages": CHAT})
    assert status == 404
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    status, _, data = request(server, "GET", "/v1/models/nope")
    assert status == 404


@pytest.mark.parametrize("raw, content_type, status, code", [
    (b"", "application/json", 400, "invalid_json"),
    (b"{", "application/json", 400, "invalid_json"),
    (b"[1, 2]", "application/json", 400, "invalid_json"),
    (b'{"model": NaN}', "application/json", 400, "invalid_json"),
    (b"\xff\xfe", "application/json", 400, "invalid_json"),
    (b"[" * 20000 + b"]" * 20000, "application/json", 400, "invalid_json"),
    (b'{"a": 1' + b"1" * 5000 + b"}", "application/json", 400, "invalid_json"),
    (b"model=tiny", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    (b"{}", "text/plain", 415, "unsupported_media_type"),
])
def test_malformed_bodies_are_4xx(server, raw, content_type, status, code) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        got, _, body = post(server, path, None, raw=raw, headers={"Content-Type": content_type})
        assert got == status and error_of(body)["code"] == code, body
    got, _, body = post(server, "/v1/messages", None, raw=raw, headers={"Content-Type": content_type})
    assert got == status and body["type"] == "error", body


def test_body_over_max_body_is_413_request_too_large(server: HTTPServer) -> None:
    oversized = json.dumps({"model": MODEL, "messages": [{"role": "user",
                                                           "content": "x" * 70_000}]}).encode()
    status, _, body = post(server, "/v1/chat/completions", None, raw=oversized)
    assert status == 413 and error_of(body)["code"] == "request_too_large"
    # Without a Content-Length (chunked upload) the limit holds while reading.
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    connection.request("POST", "/v1/chat/completions", body=iter([oversized[:40_000],
                                                                   oversized[40_000:]]),
                       headers={"Content-Type": "application/json"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_unknown_route_and_method_are_json_4xx(server: HTTPServer) -> None:
    status, headers, data = request(server, "GET", "/v2/nothing")
    assert status == 404 and "error" in json.loads(data)
    status, headers, data = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and "POST" in headers.get("allow", "")


# -- after the first byte -----------------------------------------------------------------


def open_stream(server: HTTPServer, path: str, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, count: int = 1) -> bytes:
    data = b""
    while data.count(marker) < count:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {data!r}"
        data += chunk
    return data


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"chunked" in head.lower()
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2:]
    return body


STREAMED = {
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 3000},
    "/v1/completions": {"prompt": "Say something.", "max_tokens": 3000},
    "/v1/messages": {"messages": CHAT, "max_tokens": 3000},
    "/v1/responses": {"input": "Say something.", "max_output_tokens": 3000},
}


@pytest.mark.parametrize("path", list(STREAMED))
def test_error_after_the_first_byte_travels_in_band(context: ServerContext, path: str) -> None:
    with HTTPServer(context, port=0) as server:
        sock = open_stream(server, path, {"model": MODEL, "stream": True, "temperature": 0,
                                          **STREAMED[path]})
        head = read_until(sock, b"data: ", 3)
        assert head.startswith(b"HTTP/1.1 200")
        assert server.frontend.pipeline.in_flight.abort_all() == 1  # what a shutdown does mid-stream
        raw = head + read_all(sock)
        sock.close()
    events = sse_events(dechunk(raw))
    if path == "/v1/messages":
        # Anthropic streams end with the error event itself.
        name, payload = events[-1]
        assert name == "error" and json.loads(payload)["type"] == "error"
        assert "aborted" in json.loads(payload)["error"]["message"]
        assert all(n != "error" for n, _ in events[:-1])
    elif path == "/v1/responses":
        # A Responses stream ends with an error event in place of response.completed.
        name, payload = events[-1]
        error = json.loads(payload)
        assert name == "error" and error["type"] == "error" and "aborted" in error["message"]
        assert error["code"] and "param" in error
        assert [n for n, _ in events[:-1] if n in ("error", "response.completed")] == []
        assert events[0][0] == "response.created"
    else:
        assert events[-1] == (None, "[DONE]")
        assert "aborted" in json.loads(events[-2][1])["error"]["message"]
        assert all("error" not in json.loads(p) for _, p in events[:-2])
    assert wait_for(lambda: engine_idle(context))


def test_client_disconnect_mid_stream_aborts_the_request(context, server) -> None:
    engine = context.engines[MODEL]
    before = engine.stats()
    aborted_before = before["finished"]["abort"]
    sock = open_stream(server, "/v1/chat/completions",
                       {"model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 3000,
                        "temperature": 0})
    read_until(sock, b"data: ", 3)
    assert engine.stats()["running"] == 1
    sock.close()
    assert wait_for(lambda: engine_idle(context), timeout=60), engine.stats()
    stats = engine.stats()
    assert stats["finished"]["abort"] == aborted_before + 1
    assert stats["tokens_generated"] - before["tokens_generated"] < 3000
    # /health shows the engine's nested counters flattened, as /metrics does.
    _, _, data = request(server, "GET", "/health")
    assert json.loads(data)["engines"][MODEL]["finished_abort"] == aborted_before + 1
    assert wait_for(lambda: len(server.frontend.pipeline.in_flight) == 0)
    guard = context.memory_guard
    assert guard is None or wait_for(lambda: guard.admission.running == 0)


def test_client_disconnect_during_a_non_streaming_request_aborts_it(context, server) -> None:
    engine = context.engines[MODEL]
    aborted_before = engine.stats()["finished"]["abort"]
    sock = open_stream(server, "/v1/completions",
                       {"model": MODEL, "prompt": "x", "max_tokens": 3000, "temperature": 0})
    assert wait_for(lambda: engine.stats()["running"] == 1, timeout=60)
    sock.close()
    assert wait_for(lambda: engine_idle(context), timeout=60), engine.stats()
    assert engine.stats()["finished"]["abort"] == aborted_before + 1


# -- API keys ------------------------------------------------------------------------------


def test_api_keys_both_header_styles(context: ServerContext) -> None:
    frontend = build_frontend(context, api_keys=["k-one", "k-two"])
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    with HTTPServer(context, port=0, frontend=frontend) as server:
        status, headers, response = post(server, "/v1/chat/completions", body)
        assert status == 401 and error_of(response)["code"] == "missing_api_key"
        assert headers["www-authenticate"].startswith("Bearer")
        status, _, response = post(server, "/v1/chat/completions", body,
                                   headers={"Authorization": "Bearer wrong"})
        assert status == 401 and error_of(response)["code"] == "invalid_api_key"
        status, _, response = post(server, "/v1/messages", {**body, "max_tokens": 2},
                                   headers={"x-api-key": "wrong"})
        assert status == 401 and response["error"]["type"] == "authentication_error"
        assert post(server, "/v1/chat/completions", body,
                    headers={"Authorization": "Bearer k-two"})[0] == 200
        assert post(server, "/v1/chat/completions", body, headers={"x-api-key": "k-one"})[0] == 200
        assert request(server, "GET", "/metrics")[0] == 401
        assert request(server, "GET", "/health")[0] == 200
        # Non-ASCII garbage in the header is a 401, not a crash.
        status, _, _ = request(server, "GET", "/v1/models",
                               headers={"Authorization": "Bearer \xe9\xff"})
        assert status == 401


# -- the memory guard: 413 before any work -----------------------------------------------------

MIB = 1 << 20


def small_ceiling() -> str:
    """A custom ceiling of 512 MiB, or 256 MiB over what this process holds now if that
    is more: earlier tests in the same process (a GGUF conversion) can leave memory
    resident, and the guard rightly counts it as in use."""
    import ctypes
    import ctypes.util

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return str(max(512 * MIB, footprint_bytes() + 256 * MIB))


@pytest.fixture(scope="module")
def guarded_context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerContext]:
    context = start_context(tmp_path_factory.mktemp("guarded"), tiny_dir,
                            memory__tier="custom", memory__custom_ceiling=small_ceiling(),
                            engine__max_context="2000000")
    yield context
    stop_engines(context)


def oversized_prompt(context: ServerContext) -> list[int]:
    """A token-id prompt whose estimated peak is over the hard limit by the guard's own math."""
    guard = context.memory_guard
    engine = context.engines[MODEL]
    assert wait_for(lambda: guard.snapshot is not None)
    limit = guard.snapshot.hard_bytes
    tokens = 4096
    while tokens < 2_000_000:
        prompt = [(7 * i) % 200 + 10 for i in range(tokens)]
        estimate = guard.estimate(guard.peak_query(engine, prompt)).total
        if estimate is not None and estimate > limit:
            return prompt
        tokens *= 2
    pytest.fail(f"no prompt within 2M tokens is estimated over the {limit} B ceiling")


def test_oversized_prompt_is_413_before_any_generation_work(guarded_context) -> None:
    context = guarded_context
    prompt = oversized_prompt(context)
    engine = context.engines[MODEL]
    before = engine.stats()
    with HTTPServer(context, port=0) as server:
        for stream in (False, True):
            status, headers, body = post(server, "/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream})
            assert status == 413, body
            assert headers["content-type"].startswith("application/json")
            error = error_of(body)
            assert error["code"] == "prefill_memory_exceeded"
            assert error["type"] == "invalid_request_error"
            assert error["estimated_bytes"] > 0 and error["limit_bytes"] == \
                context.memory_guard.snapshot.hard_bytes
            assert error["binding_ceiling"] == "custom"
            assert isinstance(error["advice"], list) and error["message"]
        words = "word " * len(prompt)
        assert len(engine.tokenize(words)) >= len(prompt)
        status, _, body = post(server, "/v1/messages", {
            "model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": words}]})
        assert status == 413, body
        assert body["type"] == "error" and body["error"]["code"] == "prefill_memory_exceeded"
        assert body["error"]["binding_ceiling"] == "custom"
        status, headers, body = post(server, "/v1/responses", {
            "model": MODEL, "input": words, "max_output_tokens": 4, "stream": True})
        assert status == 413, body
        assert headers["content-type"].startswith("application/json")
        assert error_of(body)["code"] == "prefill_memory_exceeded"
        samples = scrape(server)
    after = engine.stats()
    # Nothing reached the engine: no prefill, no token, no finished request.
    for key in ("prefill_chunks", "tokens_generated", "prompt_tokens_prefilled"):
        assert after[key] == before[key], key
    assert after["finished"] == before["finished"]
    assert sample(samples, "omlx_memory_rejections_total", binding="custom", stage="preflight",
                  cause="never_fits") == 4


def test_preemptions_are_counted_by_binding_ceiling_and_stage(guarded_context) -> None:
    guard, engine = guarded_context.memory_guard, guarded_context.engines[MODEL]
    assert wait_for(lambda: guard.snapshot is not None)
    gate = guard.forward_gate_for(engine)
    gate.check_prefill(PrefillStep(MODEL, (), 0, 256, limits=guard.snapshot))
    before = guard.preempted_total()
    gate.suspend("a-request-the-engine-preempted")  # what a scheduler reports
    with HTTPServer(guarded_context, port=0) as server:
        samples = scrape(server)
    assert guard.preempted_total() == before + 1
    assert sample(samples, "omlx_memory_preemptions_total", binding="custom",
                  stage="forward") >= 1


def test_a_prompt_that_fits_still_runs_under_the_ceiling(guarded_context) -> None:
    with HTTPServer(guarded_context, port=0) as server:
        status, _, body = post(server, "/v1/completions",
                               {"model": MODEL, "prompt": "hello", "max_tokens": 3})
        assert status == 200, body


def test_memory_shortage_at_the_forward_gate_is_503_before_the_first_byte(
        guarded_context, monkeypatch) -> None:
    """A request that passed preflight and admission but meets a memory shortage at the
    forward gate: 503 with Retry-After and the gate's reason, not a 500."""
    context = guarded_context
    guard, engine = context.memory_guard, context.engines[MODEL]
    gate = guard.forward_gate_for(engine)
    assert wait_for(lambda: engine.scheduler.forward_gate is gate and guard.snapshot is not None)
    hard = guard.snapshot.hard_bytes
    monkeypatch.setattr(gate, "_usage", MemoryUsage(read_active=lambda: hard + MIB,
                                                    read_footprint=lambda: 0))
    refused_before = gate.refused_total
    # Prompts no server has seen: a prefix-cache hit (in memory, or on disk from an
    # earlier server of the same model) prefills nothing and meets no gate.
    fresh = [[{"role": "user", "content": f"Say something about the number {n}."}] for n in range(4)]
    with HTTPServer(context, port=0) as server:
        for stream in (False, True):
            status, headers, body = post(server, "/v1/chat/completions", {
                "model": MODEL, "messages": fresh.pop(), "max_tokens": 3, "stream": stream})
            assert status == 503, body
            assert int(headers["retry-after"]) >= 1
            error = error_of(body)
            assert error["code"] == "forward_memory_short" and error["type"] == "overloaded_error"
            assert "memory ran short during prefill" in error["reason"]
            assert error["stage"] == "forward" and error["advice"]
            status, headers, body = post(server, "/v1/messages", {
                "model": MODEL, "messages": fresh.pop(), "max_tokens": 3, "stream": stream})
            assert status == 503, body
            assert int(headers["retry-after"]) >= 1
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            assert body["error"]["code"] == "forward_memory_short"
            assert "memory ran short during prefill" in body["error"]["reason"]
    assert gate.refused_total == refused_before + 4
    monkeypatch.undo()
    with HTTPServer(context, port=0) as server:
        # A genuine engine failure before the first token stays a 500.
        monkeypatch.setattr(gate, "check_prefill", lambda step: 1 / 0)
        status, _, body = post(server, "/v1/chat/completions",
                               {"model": MODEL, "max_tokens": 3,
                                "messages": [{"role": "user", "content": "Name a new colour."}]})
        assert status == 500 and error_of(body)["code"] == "engine_error", body
        # The exception's text is the operator's (the log), not the client's.
        assert "division by zero" not in error_of(body)["message"]
        monkeypatch.undo()
        status, _, body = post(server, "/v1/chat/completions",
                               {"model": MODEL, "messages": CHAT, "max_tokens": 3})
        assert status == 200, body


@pytest.fixture(scope="module")
def crowded_context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerContext]:
    """Room for one request at a time and no queue: a second concurrent one is refused."""
    context = start_context(tmp_path_factory.mktemp("crowded"), tiny_dir,
                            memory__tier="custom", memory__custom_ceiling=small_ceiling(),
                            memory__tiers__custom__admit_watermark="0.05",
                            memory__queue_size="0")
    yield context
    stop_engines(context)


def test_full_admission_queue_is_503_with_retry_after(crowded_context) -> None:
    context = crowded_context
    guard = context.memory_guard
    assert wait_for(lambda: guard.snapshot is not None)
    assert guard.admission.budget_bytes(guard.snapshot) < 0, "the budget must fit nobody else"
    with HTTPServer(context, port=0) as server:
        sock = open_stream(server, "/v1/chat/completions",
                           {"model": MODEL, "messages": CHAT, "stream": True,
                            "max_tokens": 3000, "temperature": 0})
        read_until(sock, b"data: ", 2)
        status, headers, body = post(server, "/v1/chat/completions",
                                     {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert status == 503, body
        assert int(headers["retry-after"]) >= 1
        assert error_of(body)["code"] == "admission_queue_full"
        status, headers, body = post(server, "/v1/messages",
                                     {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert status == 503 and body["error"]["type"] == "overloaded_error"
        assert "retry-after" in headers
        sock.close()
        assert wait_for(lambda: guard.admission.running == 0)
        # With the first request gone its reservation is back: the next one runs.
        status, _, body = post(server, "/v1/chat/completions",
                               {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert status == 200, body


def one_at_a_time(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path,
                  queue_timeout_s: str) -> ServerContext:
    """Room for one request at a time and a queue of one that waits ``queue_timeout_s``."""
    return start_context(tmp_path_factory.mktemp("one-at-a-time"), tiny_dir,
                         memory__tier="custom", memory__custom_ceiling=small_ceiling(),
                         memory__tiers__custom__admit_watermark="0.05",
                         memory__queue_size="1", memory__queue_timeout_s=queue_timeout_s)


def holding_the_room(server: HTTPServer) -> socket.socket:
    """A stream that holds the only room, read until it decodes."""
    sock = open_stream(server, "/v1/chat/completions",
                       {"model": MODEL, "messages": CHAT, "stream": True,
                        "max_tokens": 3000, "temperature": 0})
    read_until(sock, b"data: ", 2)
    return sock


@pytest.fixture(scope="module")
def waiting_context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerContext]:
    context = one_at_a_time(tmp_path_factory, tiny_dir, "0.1")
    yield context
    stop_engines(context)


def test_a_wait_past_the_queue_timeout_is_503_admission_queue_timeout(waiting_context) -> None:
    context = waiting_context
    guard = context.memory_guard
    assert wait_for(lambda: guard.snapshot is not None)
    with HTTPServer(context, port=0) as server:
        sock = holding_the_room(server)
        status, headers, body = post(server, "/v1/chat/completions",
                                     {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert status == 503, body
        assert int(headers["retry-after"]) >= 1
        error = error_of(body)
        assert (error["code"], error["stage"], error["cause"]) == (
            "admission_queue_timeout", "admission", "queue_timeout")
        assert "memory.queue_timeout_s" in error["message"]
        status, headers, body = post(server, "/v1/messages",
                                     {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert status == 503 and body["error"]["type"] == "overloaded_error"
        assert body["error"]["code"] == "admission_queue_timeout" and "retry-after" in headers
        sock.close()
        assert wait_for(lambda: guard.admission.running == 0)


@pytest.fixture(scope="module")
def queued_context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerContext]:
    context = one_at_a_time(tmp_path_factory, tiny_dir, "600")
    yield context
    stop_engines(context)


def test_cancelling_a_request_that_waits_for_memory_is_a_409_naming_it(queued_context) -> None:
    import threading

    context = queued_context
    guard = context.memory_guard
    assert wait_for(lambda: guard.snapshot is not None)
    with HTTPServer(context, port=0) as server:
        sock = holding_the_room(server)
        second: list = []
        waiter = threading.Thread(target=lambda: second.append(post(
            server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})))
        waiter.start()

        def queued() -> list[dict]:
            _, _, data = request(server, "GET", "/dashboard/api/requests")
            return [r for r in json.loads(data)["requests"] if r.get("queue") == "memory"]

        assert wait_for(lambda: len(queued()) == 1, 60)
        (waiting,) = queued()
        assert waiting["cancellable"] is False
        status, _, data = request(server, "DELETE", f"/dashboard/api/requests/{waiting['request_id']}")
        error = error_of(json.loads(data))
        assert status == 409, error
        assert (error["code"], error["param"]) == ("request_not_cancellable", "request_id")
        assert waiting["request_id"] in error["message"] and "waits for memory" in error["message"]
        sock.close()  # the first one leaves: the second gets its room and runs
        waiter.join(60)
        (status, _, body), = second
        assert status == 200, body


# -- metrics --------------------------------------------------------------------------------


def scrape(server: HTTPServer) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, data = request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(data.decode())
            for sample in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_metrics_exposition(server: HTTPServer) -> None:
    post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    post(server, "/v1/chat/completions", {"model": "nope", "messages": CHAT})
    samples = scrape(server)
    route = "/v1/chat/completions"
    assert sample(samples, "omlx_http_requests_total", route=route, method="POST", status="200") >= 1
    assert sample(samples, "omlx_http_requests_total", route=route, method="POST", status="404") >= 1
    assert sample(samples, "omlx_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert sample(samples, "omlx_completion_tokens_total", model=MODEL) >= 2
    assert sample(samples, "omlx_queue_depth", model=MODEL) == 0
    assert sample(samples, "omlx_cache_hits", model=MODEL) is not None
    assert sample(samples, "omlx_memory_hard_limit_bytes") > 0
    assert sample(samples, "omlx_memory_ceiling_bytes", ceiling="static") > 0
    assert sample(samples, "omlx_http_requests_in_flight") == 0


# -- serve_forever ----------------------------------------------------------------------------


def test_serve_forever_prints_ready_and_stops(context: ServerContext, capsys) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = dataclasses.replace(context.config, values={
        **context.config.values, "server.port": Sourced(port, "test")})
    served = ServerContext(config=config, plugins=context.plugins, engines=context.engines,
                           memory_guard=context.memory_guard)
    stop = threading.Event()
    thread = threading.Thread(target=serve_forever, args=(served, stop))
    thread.start()
    printed = ""
    try:
        def ready() -> bool:
            nonlocal printed
            printed += capsys.readouterr().out
            return "ready" in printed

        assert wait_for(ready, timeout=10), printed
        assert f"http://127.0.0.1:{port}" in printed
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        stop.set()
        thread.join(timeout=15)
    assert not thread.is_alive()
    with pytest.raises(OSError):  # the port is closed again
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# -- schema-driven fuzzing --------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerContext]:
    """A 256-token context, so that no generated request can run for long."""
    context = start_context(tmp_path_factory.mktemp("short"), tiny_dir,
                            engine__max_context="256")
    yield context
    stop_engines(context)


def fuzz_from_openapi(context: ServerContext, post_examples: int, other_examples: int
                      ) -> tuple[Counter, set[str]]:
    """Every operation of /openapi.json driven by schemathesis (valid and invalid
    cases): the statuses by operation, and every operation's label; a 5xx fails at once."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    statuses: Counter = Counter()
    labels: set[str] = set()
    with HTTPServer(context, port=0) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            labels.add(operation.label)
            cases = (operation.as_strategy(GenerationMode.POSITIVE)
                     | operation.as_strategy(GenerationMode.NEGATIVE))
            examples = post_examples if operation.method.upper() == "POST" else other_examples

            @given(case=cases)
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            def call(case) -> None:
                response = case.call(base_url=server.url, timeout=60)
                statuses[(operation.label, response.status_code)] += 1
                assert response.status_code < 500, (operation.label, case.body, response.text)

            call()
    assert wait_for(lambda: engine_idle(context))
    # The fuzz may have unloaded or unpinned the model: serve the next tests as they expect.
    if context.pool is not None:
        context.pool.load(MODEL)
        context.pool.pin(MODEL)
    return statuses, labels


def test_fuzz_from_openapi_never_answers_5xx(short_context: ServerContext) -> None:
    statuses, _ = fuzz_from_openapi(short_context, 40, 8)
    assert sum(statuses.values()) >= 100
    posts = {label for label, status in statuses if label.startswith("POST")}
    # chat, completions, messages, count_tokens, responses, the model pool's admin actions,
    # embeddings, rerank (twice: /v1/rerank and /rerank)
    assert len(posts) == 9
    # Both valid generations and refusals were exercised.
    assert any(s == 200 for (label, s) in statuses if label.startswith("POST"))
    assert any(s == 400 for (label, s) in statuses)


@pytest.mark.slow
def test_hundreds_of_schemathesis_examples_over_every_route_answer_no_5xx(
        short_context: ServerContext) -> None:
    # 2,000 examples (320 a POST route, 80 the others) ran in 211 s with no 5xx
    # (BENCHMARKS.md, issue 37); the suite asks for a third of them (hypothesis may make
    # fewer distinct ones: 626 in one run) to stay under its 20 minutes.
    statuses, labels = fuzz_from_openapi(short_context, 60, 20)
    assert sum(statuses.values()) >= 500, sum(statuses.values())
    assert len(labels) >= 16 and labels == {label for label, _ in statuses}, \
        sorted(labels - {label for label, _ in statuses})
    assert all(status < 500 for _, status in statuses)
