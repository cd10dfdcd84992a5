"""Tool calling through the OpenAI SDK: calls constrained to the function's schema (even
from a random-weight model), streamed as delta.tool_calls, tool results in the history,
and tool definitions that cannot be used refused naming the field. The default model's
answer to a weather question is in tests/test_http_sdk.py."""

from __future__ import annotations

import json
from typing import Iterator

import jsonschema
import pytest

from omlx_core.bootstrap import stop_engines
from omlx_core.server_context import ServerContext

from conftest import start_tiny_context

openai = pytest.importorskip("openai")

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Iterator[ServerContext]:
    context = start_tiny_context(tmp_path_factory, MODEL)
    yield context
    stop_engines(context)


def check_call(call, tools=(WEATHER, TIME)) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id and call.type == "function"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_required_tool_call_is_valid_against_its_schema(client, temperature) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        temperature=temperature, seed=3, max_tokens=200, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called_and_streams_as_delta_tool_calls(client) -> None:
    forced = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=forced, temperature=0, max_tokens=200)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call(call)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=forced, temperature=0,
        max_tokens=200, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_time" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_in_the_history_are_accepted(client) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=5)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto",
     "tools[0].function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([{"type": "code_interpreter"}], "auto", "tools[0].type"),
])
def test_tools_that_cannot_be_used_are_a_400_naming_the_field(client, tools, tool_choice, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                       tool_choice=tool_choice, max_tokens=5)
    assert refused.value.body["param"] == param


anthropic = pytest.importorskip("anthropic")
CLAUDE_WEATHER = {"name": "get_weather", "description": "Current weather in a city",
                  "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


def test_anthropic_tool_use_blocks_validate_and_stream_as_input_json_delta(claude) -> None:
    reply = claude.messages.create(model=MODEL, max_tokens=200, messages=ASK, extra_body={"temperature": 0},
                                   tools=[CLAUDE_WEATHER], tool_choice={"type": "any"})
    assert reply.stop_reason == "tool_use"
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, CLAUDE_WEATHER["input_schema"])
    with claude.messages.stream(model=MODEL, max_tokens=200, messages=ASK, extra_body={"temperature": 0},
                                tools=[CLAUDE_WEATHER], tool_choice={"type": "any"}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert json.loads(partial) == use.input
    assert [b for b in final.content if b.type == "tool_use"][0].input == use.input


def test_anthropic_tool_results_in_the_history_and_count_tokens_with_tools(claude) -> None:
    history = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "21 degrees"}]}]
    reply = claude.messages.create(model=MODEL, max_tokens=5, messages=history, extra_body={"temperature": 0},
                                   tools=[CLAUDE_WEATHER], tool_choice={"type": "none"})
    assert reply.stop_reason in ("end_turn", "max_tokens")
    with_tools = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=[CLAUDE_WEATHER])
    without = claude.messages.count_tokens(model=MODEL, messages=ASK)
    assert with_tools.input_tokens > without.input_tokens  # the functions are in the prompt
