"""Every route the server documents refuses bad input with a 4xx that names the field.

:data:`BAD_INPUT` holds, for each route of ``/openapi.json`` (method and path template),
the bad requests it must refuse and the field each refusal must name — or, for a route
that takes nothing a client could get wrong, why (checked against the document: no
body, no path parameter, only free-text query parameters). A route added to the
document without an entry here fails :func:`test_every_documented_route_has_bad_input_cases`
with its name: add its cases to the table.

A refusal names its field as its API does: OpenAI-shaped errors in ``error.param``,
Anthropic-shaped ones (``/v1/messages``...) in the message.
"""

from __future__ import annotations

import http.client
import json
import re
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import quote

import pytest

from conftest import start_tiny_context
from omlx_core.http.errors import is_anthropic_path
from omlx_core.server_context import ServerContext

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Say something."}]


@dataclass(frozen=True)
class Bad:
    """A bad request to a route (``path`` with its path parameters and query filled in)
    and what the answer must be: ``status`` and the ``field`` it names."""

    path: str
    body: Any = None
    field: str = ""
    status: int = 400


@dataclass(frozen=True)
class NoInput:
    """A route that takes nothing a client could get wrong, and why."""

    why: str


def _messages(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": CHAT, **fields}


def _without(body: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != field}


def _count(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, **fields}


def _response(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "Say something.", "max_output_tokens": 8, **fields}


def _posts(path: str, cases: list[tuple[dict[str, Any], str]]) -> list[Bad]:
    return [Bad(path, body, field) for body, field in cases]


BAD_INPUT: dict[tuple[str, str], list[Bad] | NoInput] = {
    # The chat route's full table is tests/test_http_api.py's; these keep it in this one.
    ("POST", "/v1/chat/completions"): _posts("/v1/chat/completions", [
        ({"messages": CHAT}, "model"),
        ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ]),
    ("POST", "/v1/completions"): _posts("/v1/completions", [
        ({"model": MODEL}, "prompt"),
        ({"prompt": "x"}, "model"),
        ({"model": MODEL, "prompt": "x", "n": 3}, "n"),
        ({"model": MODEL, "prompt": ["one", "two"]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "logprobs": 99}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x", "top_p": 7}, "top_p"),
    ]),
    # The embedding and rerank routes' full tables are tests/test_embeddings_http.py's (on
    # a server with an embedder and a reranker); here, on a chat model only.
    ("POST", "/v1/embeddings"): _posts("/v1/embeddings", [
        ({"input": "a"}, "model"),
        ({"model": "", "input": "a"}, "model"),
        ({"model": MODEL, "input": "a"}, "model"),
        ({"model": MODEL, "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ]),
    ("POST", "/v1/rerank"): _posts("/v1/rerank", [
        ({"model": MODEL, "query": "q", "documents": ["a"]}, "model"),
        ({"model": MODEL, "query": "q", "documents": []}, "documents"),
    ]),
    ("POST", "/rerank"): _posts("/rerank", [
        ({"model": MODEL, "query": "q", "documents": ["a"]}, "model"),
        ({"model": MODEL, "documents": ["a"]}, "query"),
    ]),
    ("POST", "/v1/messages"): _posts("/v1/messages", [
        (_without(_messages(), "model"), "model"),
        (_without(_messages(), "max_tokens"), "max_tokens"),
        (_without(_messages(), "messages"), "messages"),
        (_messages(messages=[]), "messages"),
        (_messages(max_tokens=0), "max_tokens"),
        (_messages(temperature=1.5), "temperature"),
        (_messages(top_p=0), "top_p"),
        (_messages(top_k=-1), "top_k"),
        (_messages(stream="yes"), "stream"),
        (_messages(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
        (_messages(messages=[{"role": "user"}]), "messages[0]"),
        (_messages(messages=[{"role": "user", "content": [{"type": "video"}]}]),
         "messages[0].content[0].type"),
        (_messages(system=5), "system"),
        (_messages(stop_sequences=[""]), "stop_sequences[0]"),
        (_messages(stop_sequences=["x"] * 17), "stop_sequences"),
        (_messages(tools=[]), "tools"),
        (_messages(tool_choice={"type": "sometimes"}), "tool_choice.type"),
        (_messages(thinking={"type": "sometimes"}), "thinking.type"),
        (_messages(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking.budget_tokens"),
    ]),
    ("POST", "/v1/messages/count_tokens"): _posts("/v1/messages/count_tokens", [
        (_without(_count(), "model"), "model"),
        (_without(_count(), "messages"), "messages"),
        (_count(messages=[]), "messages"),
        (_count(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (_count(messages=[{"role": "user", "content": [{"type": "video"}]}]),
         "messages[0].content[0].type"),
        (_count(system=5), "system"),
        (_count(tools=[]), "tools"),
        (_count(tool_choice={"type": "sometimes"}), "tool_choice.type"),
        (_count(thinking={"type": "sometimes"}), "thinking.type"),
    ]),
    ("POST", "/v1/responses"): _posts("/v1/responses", [
        (_without(_response(), "model"), "model"),
        (_without(_response(), "input"), "input"),
        (_response(input=""), "input"),
        (_response(input=[{"type": "image_generation_call"}]), "input[0].type"),
        (_response(input=[{"type": "message", "role": "robot", "content": "x"}]), "input[0].role"),
        (_response(input=[{"type": "message", "role": "user",
                           "content": [{"type": "input_image", "text": "x"}]}]),
         "input[0].content[0].type"),
        (_response(max_output_tokens=0), "max_output_tokens"),
        (_response(temperature="hot"), "temperature"),
        (_response(top_p=7), "top_p"),
        (_response(instructions=5), "instructions"),
        (_response(store="yes"), "store"),
        (_response(previous_response_id="resp_123"), "previous_response_id"),
        (_response(truncation="auto"), "truncation"),
        (_response(tools=[]), "tools"),
        (_response(tool_choice="sometimes"), "tool_choice"),
        (_response(text={"format": {"type": "json_schema"}}), "text.format.type"),
        (_response(reasoning={"effort": "extreme"}), "reasoning.effort"),
    ]),
    ("GET", "/v1/models"): NoInput("lists the models; it takes no parameter"),
    ("GET", "/v1/models/{model_id}"): [Bad("/v1/models/no-such-model", field="model", status=404)],
    ("POST", "/admin/models/{model_id}/{action}"): [
        Bad("/admin/models/no-such-model/load", field="model", status=404),
        Bad(f"/admin/models/{MODEL}/explode", field="action", status=404),
    ],
    ("GET", "/health"): NoInput("liveness; it takes no parameter"),
    ("GET", "/metrics"): NoInput("the Prometheus exposition; it takes no parameter"),
    ("GET", "/openapi.json"): NoInput("this document; it takes no parameter"),
    ("GET", "/dashboard"): NoInput("the page; it takes no parameter"),
    ("GET", "/dashboard/api/history"): [
        Bad("/dashboard/api/history?since=yesterday", field="since"),
        Bad("/dashboard/api/history?since=nan", field="since"),
    ],
    ("GET", "/dashboard/api/requests"): NoInput("lists the requests in flight; no parameter"),
    ("DELETE", "/dashboard/api/requests/{request_id}"): [
        Bad("/dashboard/api/requests/no-such-request", field="request_id", status=404),
    ],
    ("GET", "/dashboard/api/refusals"): NoInput(
        "request_id is a substring to filter on: every string is one (no match: no rows)"),
    ("GET", "/dashboard/api/models"): NoInput("lists the models; it takes no parameter"),
}


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerContext]:
    from omlx_core.bootstrap import stop_engines

    context = start_tiny_context(tmp_path_factory, MODEL)
    yield context
    stop_engines(context)


def call(server: Any, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        payload = None if body is None else json.dumps(body).encode()
        # As a real client: a POST declares JSON even without a body (the server refuses
        # undeclared POSTs with 415, the browser guard's own test covers that).
        headers = ({"Content-Type": "application/json"}
                   if payload is not None or method == "POST" else {})
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        data = response.read()
        kind = response.getheader("Content-Type") or ""
        return response.status, json.loads(data) if kind.startswith("application/json") else {}
    finally:
        connection.close()


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/?]+", re.escape(template)) + r"(\?.*)?$")


CASES = [(method, template, bad) for (method, template), cases in BAD_INPUT.items()
         if isinstance(cases, list) for bad in cases]


def test_every_documented_route_has_bad_input_cases(server) -> None:
    _, document = call(server, "GET", "/openapi.json")
    documented = {(method.upper(), path) for path, item in document["paths"].items()
                  for method in item if method in ("get", "post", "put", "patch", "delete")}
    missing = sorted(documented - set(BAD_INPUT))
    assert not missing, ("routes in /openapi.json with no bad-input cases; add each to BAD_INPUT "
                         "in tests/test_http_bad_input.py (its bad requests and the field each "
                         "4xx names, or NoInput and why): "
                         + ", ".join(f"{m} {p}" for m, p in missing))
    stale = sorted(set(BAD_INPUT) - documented)
    assert not stale, "BAD_INPUT lists routes /openapi.json does not: " + ", ".join(
        f"{m} {p}" for m, p in stale)
    for (method, template), cases in BAD_INPUT.items():
        operation = document["paths"][template][method.lower()]
        if isinstance(cases, NoInput):
            assert "requestBody" not in operation, f"{method} {template} takes a body"
            for parameter in operation.get("parameters", []):
                assert parameter["in"] == "query" and parameter["schema"] == {"type": "string"}, (
                    f"{method} {template}: its {parameter['in']} parameter {parameter['name']} "
                    f"can be wrong; give it bad-input cases")
        else:
            assert cases, f"{method} {template} has an empty list of bad inputs"
            for bad in cases:
                assert _pattern(template).match(bad.path), f"{bad.path} is not {template}"


@pytest.mark.parametrize("method, template, bad", CASES,
                         ids=[f"{m} {b.path} {b.field}" for m, _, b in CASES])
def test_bad_input_is_a_4xx_naming_the_field(server, method, template, bad) -> None:
    status, body = call(server, method, bad.path, bad.body)
    assert status == bad.status, body
    if is_anthropic_path(bad.path.split("?")[0]):
        assert body["type"] == "error", body
        assert bad.field in body["error"]["message"], body
    else:
        error = body["error"]
        assert error["param"] == bad.field, error
        assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error"), error


def test_the_route_pattern_matches_only_its_route() -> None:
    assert _pattern("/v1/models/{model_id}").match("/v1/models/" + quote("a b"))
    assert not _pattern("/v1/models/{model_id}").match("/v1/models/a/b")
    assert _pattern("/dashboard/api/history").match("/dashboard/api/history?since=x")
    assert not _pattern("/v1/messages").match("/v1/messages/count_tokens")
