"""The front end's pure parts: schema checking and its messages, token bytes for
logprobs, the two error shapes, and how each error reaches the wire."""

from __future__ import annotations

import falcon
import falcon.testing
import pytest

from omlx_core.http.errors import (APIError, anthropic_error_body, install_error_handlers,
                                   openai_error_body)
from omlx_core.grammar import GrammarBusy
from omlx_core.memory.types import Rejection, RequestRejected
from omlx_core.serving import EngineFailed, InvalidRequest, RequestAborted, UnknownModel
from omlx_core.http.schemas import CHAT_COMPLETION_REQUEST, COMPLETION_REQUEST, MESSAGES_REQUEST
from omlx_core.http.validation import SchemaViolation, validate
from omlx_core.models.tokens import TokenTexts
from omlx_core.testing import cached_model


def violation(body: dict, schema: dict = CHAT_COMPLETION_REQUEST) -> SchemaViolation:
    with pytest.raises(SchemaViolation) as raised:
        validate(body, schema)
    return raised.value


CHAT = [{"role": "user", "content": "hi"}]


def test_valid_requests_pass() -> None:
    validate({"model": "m", "messages": CHAT, "stop": None, "temperature": None, "n": 1,
              "stream_options": {"include_usage": True}, "logit_bias": {"12": -100},
              "anything_else": {"ignored": True}}, CHAT_COMPLETION_REQUEST)
    validate({"model": "m", "prompt": [1, 2, 3], "echo": False, "suffix": None},
             COMPLETION_REQUEST)
    validate({"model": "m", "max_tokens": 5, "messages": CHAT,
              "system": [{"type": "text", "text": "s"}], "thinking": {"type": "disabled"}},
             MESSAGES_REQUEST)


@pytest.mark.parametrize("body, param, message", [
    ({"model": "m", "messages": CHAT, "temperature": True}, "temperature",
     "temperature must be a number or null, got a boolean"),
    ({"model": "m", "messages": CHAT, "top_p": 0}, "top_p", "top_p must be greater than 0"),
    ({"model": "m", "messages": CHAT, "n": 4}, "n",
     "n: only n=1 is supported; send one request per choice"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content must be null or a string or an array, got an integer"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text must be a string"),
    ({"model": "m", "messages": CHAT, "stop": ["ok", ""]}, "stop[1]", "stop[1] must not be empty"),
    ({"model": "", "messages": CHAT}, "model", "model must not be empty"),
])
def test_violations_name_the_parameter(body, param, message) -> None:
    found = violation(body)
    assert found.param == param
    assert found.message.startswith(message), found.message


def test_completion_prompt_alternatives_explain_the_closest_one() -> None:
    assert "exactly one prompt string" in violation(
        {"model": "m", "prompt": ["a", "b"]}, COMPLETION_REQUEST).message
    found = violation({"model": "m", "prompt": [1, -2]}, COMPLETION_REQUEST)
    assert found.param == "prompt[1]" and "at least 0" in found.message
    assert "echo is not supported" in violation(
        {"model": "m", "prompt": "x", "echo": True}, COMPLETION_REQUEST).message


def test_non_finite_and_huge_numbers_are_rejected() -> None:
    assert "finite" in violation({"model": "m", "messages": CHAT,
                                  "temperature": float("inf")}).message
    assert violation({"model": "m", "messages": CHAT, "max_tokens": 2**80}).param == "max_tokens"


def test_token_bytes_spell_the_text_even_across_character_boundaries(tmp_path) -> None:
    from tokenizers import Tokenizer

    model_dir = cached_model("llama", 0, cache_dir=tmp_path)
    texts = TokenTexts(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Crème brûlée, 你好, emoji 😀 end"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(texts.bytes_of(i) for i in ids) == text.encode("utf-8")
    assert any("\ufffd" in texts.text_of(i) for i in ids), "some token should be half a character"


def test_error_shapes() -> None:
    body = openai_error_body(413, "too big", "prefill_memory_exceeded", None,
                             {"estimated_bytes": 5, "limit_bytes": 4})
    assert body == {"error": {"message": "too big", "type": "invalid_request_error", "param": None,
                              "code": "prefill_memory_exceeded", "estimated_bytes": 5,
                              "limit_bytes": 4}}
    assert openai_error_body(500, "bug")["error"]["type"] == "server_error"
    assert anthropic_error_body(404, "no model") == {
        "type": "error", "error": {"type": "not_found_error", "message": "no model"}}
    assert anthropic_error_body(503, "busy", "admission_queue_full")["error"] == {
        "type": "overloaded_error", "message": "busy", "code": "admission_queue_full"}


class Raises:
    """A route that raises whatever the test puts in ``error``."""

    error: Exception = RuntimeError("unset")

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raise self.error


@pytest.fixture
def raising() -> tuple[falcon.testing.TestClient, Raises]:
    app = falcon.App()
    install_error_handlers(app)
    route = Raises()
    app.add_route("/v1/chat/completions", route)
    app.add_route("/v1/messages", route)
    return falcon.testing.TestClient(app), route


def rejected(stage: str, cause: str) -> RequestRejected:
    return RequestRejected(Rejection(estimated_bytes=5, limit_bytes=4, breakdown=None,
                                     stage=stage, cause=cause, detail=f"{cause} happened"),
                           advice=["wait"], retry_after_s=2.6)


@pytest.mark.parametrize("stage, cause, status, code", [
    ("preflight", "never_fits", 413, "prefill_memory_exceeded"),
    ("admission", "queue_full", 503, "admission_queue_full"),
    ("admission", "queue_timeout", 503, "admission_queue_timeout"),
    ("forward", "memory_short", 503, "forward_memory_short"),
    ("forward", "over_limit", 503, "forward_over_limit"),
    # No plugin estimates the model: no retry can help, so no Retry-After.
    ("forward", "no_estimate", 500, "model_not_estimable"),
    ("preflight", "no_estimate", 500, "model_not_estimable"),
])
def test_a_memory_refusal_is_coded_by_its_stage_and_cause(raising, stage, cause, status,
                                                          code) -> None:
    client, route = raising
    route.error = rejected(stage, cause)
    openai = client.simulate_post("/v1/chat/completions")
    anthropic = client.simulate_post("/v1/messages")
    for response in (openai, anthropic):
        assert response.status_code == status
        assert response.headers.get("retry-after") == (None if status != 503 else "3")
    assert openai.json["error"]["code"] == code and openai.json["error"]["stage"] == stage
    assert openai.json["error"]["cause"] == cause and openai.json["error"]["advice"] == ["wait"]
    assert anthropic.json["type"] == "error" and anthropic.json["error"]["code"] == code
    assert anthropic.json["error"]["type"] == {413: "request_too_large", 500: "api_error",
                                               503: "overloaded_error"}[status]


@pytest.mark.parametrize("error, status, code, param", [
    (InvalidRequest("bad n", "n"), 400, "invalid_request", "n"),
    (UnknownModel("nope", ["tiny"]), 404, "model_not_found", "model"),
    (RequestAborted("the server is shutting down"), 503, "aborted", None),
    (EngineFailed("the engine died"), 500, "engine_error", None),
    (ZeroDivisionError("a bug"), 500, "internal_error", None),
    # only what a client sent nests deep enough to exhaust the parser's recursion
    (RecursionError("maximum recursion depth exceeded"), 400, "nested_too_deep", None),
    (GrammarBusy("the grammar compile queue is full", 4.2), 503, "grammar_compile_busy", None),
])
def test_every_error_is_one_of_falcons_in_both_shapes(raising, error, status, code,
                                                      param) -> None:
    client, route = raising
    route.error = error
    openai = client.simulate_post("/v1/chat/completions", headers={"Accept": "text/html"})
    anthropic = client.simulate_post("/v1/messages")
    assert openai.status_code == anthropic.status_code == status
    assert openai.headers["content-type"] == "application/json"
    assert (openai.json["error"]["code"], openai.json["error"]["param"]) == (code, param)
    assert anthropic.json["error"]["code"] == code
    if isinstance(error, ZeroDivisionError):  # a bug keeps its details in the log
        assert "a bug" not in openai.text and "ZeroDivisionError" in openai.text
    if isinstance(error, GrammarBusy):  # the compile queue is full now: retry later
        assert openai.headers["retry-after"] == "5"


def test_our_errors_are_falcons_error_classes() -> None:
    from omlx_core.http.errors import api_error, bad_request, rejection_error

    assert isinstance(bad_request("bad", "n"), falcon.HTTPBadRequest)
    assert isinstance(rejection_error(rejected("preflight", "never_fits")),
                      falcon.HTTPContentTooLarge)
    overloaded = rejection_error(rejected("admission", "queue_timeout"))
    assert isinstance(overloaded, falcon.HTTPServiceUnavailable)
    assert dict(overloaded.headers) == {"Retry-After": "3"}
    assert isinstance(api_error(UnknownModel("nope", [])), falcon.HTTPNotFound)
    assert isinstance(api_error(EngineFailed("x")), falcon.HTTPInternalServerError)
    assert all(isinstance(e, APIError) for e in (overloaded, api_error(EngineFailed("x"))))


def test_api_keys_come_from_the_environment(monkeypatch) -> None:
    import falcon.testing

    from omlx_core.bootstrap import load_setup
    from omlx_core.http import build_frontend
    from omlx_core.server_context import ServerContext

    monkeypatch.setenv("OMLX_SERVER_API_KEYS", "env-key-1,env-key-2")
    setup = load_setup("cpu-small")
    client = falcon.testing.TestClient(build_frontend(ServerContext(setup.config,
                                                                    setup.plugins)).app,
                                       headers={"Host": "localhost"})
    assert client.simulate_get("/v1/models").status_code == 401
    assert client.simulate_get("/v1/models", headers={"x-api-key": "env-key-2"}).status_code == 200
    assert client.simulate_get(
        "/v1/models", headers={"Authorization": "Bearer env-key-1"}).status_code == 200
    document = client.simulate_get("/openapi.json").json
    assert set(document["components"]["securitySchemes"]) == {"bearer", "apiKey"}
