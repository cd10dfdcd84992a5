"""The batched engine's prompt-lookup speculation reaches every API's usage: a request
whose answer copies its prompt, on the real default model served as ``serve`` serves it,
reports its drafted and accepted tokens to the official OpenAI and Anthropic SDKs (chat
completions, Responses, Messages); with ``plugin.batched.speculation = false`` nothing is
drafted and the usage says nothing about drafts."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.http import HTTPServer
from omlx_core.server_context import ServerContext

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PASSAGE = ("The memory guard refuses a request that can never fit before a single byte of "
           "the response is sent. A request that fits alone but not next to the running ones "
           "waits. A prefill chunk that would overshoot the ceiling is refused before the "
           "forward runs.")
ASK = "Repeat this text word for word:\n\n" + PASSAGE


@pytest.fixture(scope="module", params=[True, False], ids=["speculation", "no-speculation"])
def served(request, default_model_dir) -> Iterator[tuple[HTTPServer, bool]]:
    overrides = [("plugin.batched.speculation", str(request.param).lower(), "test")]
    context: ServerContext = start_engines(load_setup("cpu-small", [], overrides), progress=False)
    try:
        with HTTPServer(context, port=0) as server:
            yield server, request.param
    finally:
        stop_engines(context)


def check(usage: dict[str, Any], speculation: bool, api: str) -> None:
    speculative = usage.get("speculative")
    if not speculation:
        assert speculative is None, (api, usage)
        return
    assert speculative is not None, (api, usage)
    drafted, accepted = speculative["drafted_tokens"], speculative["accepted_tokens"]
    assert 0 < accepted <= drafted, (api, usage)
    assert speculative["acceptance_rate"] == round(accepted / drafted, 4), (api, usage)


def test_every_api_reports_the_requests_drafts(served) -> None:
    server, speculation = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASK}], temperature=0,
            max_tokens=48)
        usage = chat.usage.model_dump()
        check(usage, speculation, "chat completions")
        if speculation:
            details = usage["completion_tokens_details"]
            assert details["accepted_prediction_tokens"] == usage["speculative"]["accepted_tokens"]
            assert details["rejected_prediction_tokens"] == \
                usage["speculative"]["drafted_tokens"] - usage["speculative"]["accepted_tokens"]
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASK}], temperature=0,
            max_tokens=48, stream=True, stream_options={"include_usage": True})
        streamed = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(streamed) == 1
        check(streamed[0].model_dump(), speculation, "chat completions, streamed")
        response = client.responses.create(model=MODEL, input=ASK, temperature=0,
                                           max_output_tokens=48)
        check(response.usage.model_dump(), speculation, "responses")
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=48, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": ASK}])
        check(message.usage.model_dump(), speculation, "messages")
        with claude.messages.stream(model=MODEL, max_tokens=48, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": ASK}]) as events:
            # The SDK's accumulated message keeps only the usage fields it knows: read
            # the final counts where they come, in the message_delta event.
            deltas = [event.usage.model_dump() for event in events if event.type == "message_delta"]
        assert len(deltas) == 1
        check(deltas[0], speculation, "messages, streamed")
