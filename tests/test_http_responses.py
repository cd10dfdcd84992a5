"""OpenAI's Responses API and Anthropic's count_tokens, through the official SDKs against
a real server on a tiny model: answers, streamed events, usage, refusals before any
byte and errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from omlx_core.bootstrap import stop_engines
from omlx_core.server_context import ServerContext

from conftest import start_tiny_context

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MODEL = "tiny"


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Iterator[ServerContext]:
    context = start_tiny_context(tmp_path_factory, MODEL)
    yield context
    stop_engines(context)


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


def test_a_response_is_one_assistant_message_with_usage(client) -> None:
    response = client.responses.create(model=MODEL, input="Say something.", max_output_tokens=6,
                                       temperature=0, instructions="Be brief.")
    assert response.object == "response" and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == response.output[0].content[0].text
    assert response.usage.output_tokens <= 6 and response.usage.input_tokens > 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_sends_the_event_sequence_and_the_same_text(client) -> None:
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]}]
    whole = client.responses.create(model=MODEL, input=messages, max_output_tokens=8,
                                    temperature=0)
    events = list(client.responses.create(model=MODEL, input=messages, max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_what_responses_cannot_do_is_a_400_naming_the_field(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert refused.value.body["param"] == "previous_response_id"
    assert "not stored" in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")


def test_count_tokens_counts_what_messages_would_prefill(context, claude) -> None:
    engine = context.engines[MODEL]
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    expected = engine.tokenize_chat([{"role": "system", "content": "Be brief."}, *messages])
    assert counted.input_tokens == len(expected)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="nope", messages=messages)


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


def test_function_tools_on_responses_call_and_stream_their_arguments(client) -> None:
    import json

    response = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_output_tokens=80)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 20
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                          tool_choice="required", temperature=0,
                                          max_output_tokens=80, stream=True))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == call.arguments
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call" and done[-1].item.arguments == call.arguments
    followup = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none",
                                       max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert followup.status in ("completed", "incomplete")
