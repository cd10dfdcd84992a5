"""Reasoning models through the official SDKs against a real server on loopback: tiny
random models taught each reasoning and tool-call format by the test chat templates
(:mod:`omlx_core.testing.chat_formats`), streamed and not.

- the openai SDK's chat (``reasoning_content``, streamed as ``delta.reasoning_content``)
  and Responses (reasoning items and their events);
- the anthropic SDK with ``thinking`` enabled and tools, in a multi-turn loop that sends
  the thinking blocks back;
- every tool-call format, its calls valid for their schema, streamed as deltas;
- a thinking budget that ends thinking within the budget on a model that would think
  longer; greedy tokens identical with and without reasoning parsing;
- models that do not reason ignore the fields; bad input is a 400 naming the field.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Iterator

import jsonschema
import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model
from omlx_core.testing.chat_formats import cached_format_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                reason="xgrammar is not installed (./setup.sh installs it)")

FORMAT_MODELS = ("r1", "qwen3", "qwen3_coder", "glm45", "harmony", "pythonic")
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": WEATHER_SCHEMA}}
CLAUDE_WEATHER = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Iterator[ServerContext]:
    root = tmp_path_factory.mktemp("models")
    entries = {name: cached_format_model(name, cache_dir=root) for name in FORMAT_MODELS}
    config = tmp_path_factory.mktemp("config") / "omlx.toml"
    lines = [f"[server]\nmodels = {json.dumps([*FORMAT_MODELS, 'r1-unparsed', 'qwen3-pythonic', 'plain'])}\n"]
    lines += [f'[models.{name}]\npath = "{path}"\n' for name, path in entries.items()]
    # The same weights and template, its reply not split: the tokens must not change.
    lines.append(f'[models.r1-unparsed]\npath = "{entries["r1"]}"\nreasoning_format = "none"\n')
    # A template that shows hermes calls, told by its table to call in another format.
    lines.append(f'[models.qwen3-pythonic]\npath = "{entries["qwen3"]}"\ntool_call_format = "pythonic"\n')
    lines.append(f'[models.plain]\npath = "{cached_model("llama", 0, cache_dir=root)}"\n')
    config.write_text("\n".join(lines))
    context = start_engines(load_setup("cpu-small", [config]), progress=False)
    yield context
    stop_engines(context)


# -- openai chat ---------------------------------------------------------------------------


def test_chat_returns_the_thinking_as_reasoning_content_streamed_and_not(client) -> None:
    request = dict(model="r1", messages=ASK, temperature=0, max_tokens=40,
                   extra_body={"thinking_token_budget": 12})
    whole = client.chat.completions.create(**request)
    message = whole.choices[0].message
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    assert message.content and "</think>" not in message.content[:1]
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens <= 12 < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(**request, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_a_budget_ends_thinking_within_it_on_a_model_that_would_think_longer(client) -> None:
    unbounded = client.chat.completions.create(model="r1", messages=ASK, temperature=0, max_tokens=48)
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 48  # never closes it
    assert not unbounded.choices[0].message.content
    for budget in (1, 5, 16):
        capped = client.chat.completions.create(model="r1", messages=ASK, temperature=0, max_tokens=48,
                                                extra_body={"thinking_token_budget": budget})
        assert capped.usage.completion_tokens_details.reasoning_tokens <= budget
        assert capped.choices[0].message.content  # it went on to answer


def test_greedy_tokens_are_the_same_with_and_without_reasoning_parsing(client) -> None:
    def tokens(model: str):
        reply = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=30,
                                               logprobs=True)
        return reply, [bytes(t.bytes) for t in reply.choices[0].logprobs.content]

    parsed, parsed_tokens = tokens("r1")
    unparsed, unparsed_tokens = tokens("r1-unparsed")
    assert parsed_tokens == unparsed_tokens and len(parsed_tokens) == 30
    assert parsed.choices[0].message.reasoning_content  # parsing changed the fields...
    assert unparsed.choices[0].message.content == b"".join(unparsed_tokens).decode("utf-8", "replace")
    assert getattr(unparsed.choices[0].message, "reasoning_content", None) is None


def test_structured_output_constrains_the_answer_not_the_thinking(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model="r1", messages=ASK, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"thinking_token_budget": 10})
    message = reply.choices[0].message
    assert message.reasoning_content
    jsonschema.validate(json.loads(message.content), schema)


# -- openai responses ----------------------------------------------------------------------


def test_responses_return_a_reasoning_item_streamed_and_not(client) -> None:
    request = dict(model="r1", input="What is the weather in Paris?", temperature=0, max_output_tokens=16,
                   reasoning={"effort": "high"})
    whole = client.responses.create(**request)
    kinds = [item.type for item in whole.output]
    assert kinds[0] == "reasoning"
    thinking = whole.output[0].content[0].text
    assert thinking and whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(**request, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thinking
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[0].type == "reasoning" and done[0].content[0].text == thinking
    final = events[-1].response
    assert [item.type for item in final.output] == kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # A reasoning item sent back with the conversation is accepted.
    followup = client.responses.create(model="r1", temperature=0, max_output_tokens=4, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "reasoning", "id": whole.output[0].id, "summary": [],
         "content": [{"type": "reasoning_text", "text": thinking}]},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"}])
    assert followup.status in ("completed", "incomplete")
    as_text = client.responses.create(model="r1", temperature=0, max_output_tokens=2, input=[
        {"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": [], "content": "plain text"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert as_text.status in ("completed", "incomplete")


# -- every tool format ---------------------------------------------------------------------


def tool_request(model: str) -> dict:
    # Thinking off where the template takes it (the calls come first); harmony's analysis
    # channel, which a random model would never leave, is closed by a budget.
    extra = {"thinking_token_budget": 12} if model == "harmony" else \
        {"chat_template_kwargs": {"enable_thinking": False}}
    # A random model pads JSON and XML with all the whitespace the grammar allows: room
    # for one whole call.
    return dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                max_tokens=400, parallel_tool_calls=False, extra_body=extra)


@pytest.mark.parametrize("model", ["qwen3", "qwen3_coder", "glm45", "pythonic", "harmony"])
def test_every_tool_format_round_trips_streamed_and_not(client, model) -> None:
    whole = client.chat.completions.create(**tool_request(model))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and all(c.function.name == "get_weather" and c.id for c in calls)
    if model == "harmony":
        assert whole.usage.completion_tokens_details.reasoning_tokens <= 12
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    chunks = list(client.chat.completions.create(**tool_request(model), stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    streamed: dict[int, str] = {}
    for piece in pieces:
        streamed[piece.index] = streamed.get(piece.index, "") + (piece.function.arguments or "")
    assert list(streamed.values()) == [c.function.arguments for c in calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = ASK + [{"role": "assistant", "content": None,
                      "reasoning_content": getattr(choice.message, "reasoning_content", None),
                      "tool_calls": [c.model_dump(exclude_none=True) for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "21 degrees"} for c in calls]
    followup = client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                              tool_choice="none", temperature=0, max_tokens=4)
    assert followup.choices[0].finish_reason in ("stop", "length")


def test_a_models_table_overrides_the_tool_call_format_its_template_shows(client) -> None:
    reply = client.chat.completions.create(**{**tool_request("qwen3"), "model": "qwen3-pythonic"})
    [call] = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    logprobs = client.chat.completions.create(**{**tool_request("qwen3"), "model": "qwen3-pythonic"},
                                              logprobs=True).choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in logprobs).lstrip().startswith(b"[get_weather(")


# -- anthropic -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["r1", "harmony"])
def test_anthropic_thinking_with_tools_in_a_multi_turn_loop(claude, model) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    request = dict(model=model, max_tokens=400, tools=[CLAUDE_WEATHER],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   thinking={"type": "enabled", "budget_tokens": 16}, extra_body={"temperature": 0})
    for turn in range(2):
        reply = claude.messages.create(messages=messages, **request)
        kinds = [block.type for block in reply.content]
        assert kinds[0] == "thinking" and reply.content[0].thinking, kinds
        assert "tool_use" in kinds and reply.stop_reason == "tool_use"
        uses = [b for b in reply.content if b.type == "tool_use"]
        for use in uses:
            jsonschema.validate(use.input, WEATHER_SCHEMA)
        with claude.messages.stream(messages=messages, **request) as stream:
            thinking = "".join(e.delta.thinking for e in stream
                               if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
            final = stream.get_final_message()
        assert thinking == reply.content[0].thinking
        assert [b.type for b in final.content] == kinds
        assert [b.input for b in final.content if b.type == "tool_use"] == [u.input for u in uses]
        # The thinking goes back with the tool uses, as Claude Code sends it.
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                   "content": f"{turn + 20} degrees"} for u in uses]}]
    # Another server's redacted thinking cannot be read: it is accepted and left out.
    messages[-2]["content"].insert(0, {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"})
    answer = claude.messages.create(model=model, max_tokens=24, messages=messages,
                                    thinking={"type": "enabled", "budget_tokens": 12},
                                    extra_body={"temperature": 0})
    assert answer.content[0].type == "thinking" and answer.stop_reason in ("end_turn", "max_tokens")
    assert "redacted_thinking" not in [b.type for b in answer.content]
    assert claude.messages.count_tokens(model=model, messages=messages,
                                        thinking={"type": "enabled", "budget_tokens": 12}).input_tokens > 0


def test_thinking_disabled_renders_no_thinking_for_templates_that_take_it(claude, context) -> None:
    engine = context.engines["qwen3"]
    on = claude.messages.count_tokens(model="qwen3", messages=ASK)
    off = claude.messages.count_tokens(model="qwen3", messages=ASK, thinking={"type": "disabled"})
    assert off.input_tokens == len(engine.tokenize_chat(ASK, enable_thinking=False)) > on.input_tokens


# -- models that do not reason, and bad input ----------------------------------------------


def test_a_model_that_does_not_reason_ignores_the_reasoning_fields(client, claude) -> None:
    reply = client.chat.completions.create(
        model="plain", messages=ASK, temperature=0, max_tokens=6, reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 3})
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    message = claude.messages.create(model="plain", max_tokens=6, messages=ASK,
                                     thinking={"type": "enabled", "budget_tokens": 4},
                                     extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["text"]
    response = client.responses.create(model="plain", input="hi", max_output_tokens=4,
                                       reasoning={"effort": "medium"})
    assert [item.type for item in response.output] == ["message"]


@pytest.mark.parametrize("body, param", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"thinking_token_budget": 0}, "thinking_token_budget"),
    ({"thinking_token_budget": 9, "max_tokens": 8}, "thinking_token_budget"),
])
def test_bad_reasoning_fields_on_chat_are_a_400_naming_them(client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="r1", messages=ASK, max_tokens=body.get("max_tokens", 8),
                                       extra_body={k: v for k, v in body.items() if k != "max_tokens"})
    assert refused.value.body["param"] == param
    assert refused.value.status_code == 400


@pytest.mark.parametrize("thinking, param", [
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 65}, "thinking.budget_tokens"),
    ({"type": "sometimes"}, "thinking.type"),
])
def test_bad_thinking_on_messages_is_a_400_naming_the_field(claude, thinking, param) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="r1", max_tokens=64, messages=ASK, thinking=thinking)
    assert param in refused.value.body["error"]["message"]


def test_a_bad_reasoning_effort_on_responses_is_a_400_naming_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="r1", input="hi", reasoning={"effort": "maximal"})
    assert refused.value.body["param"] == "reasoning.effort"


@pytest.mark.parametrize("key, value", [("tool_call_format", "qwen4"), ("reasoning_format", "thoughts")])
def test_an_unknown_format_in_config_is_a_startup_error_naming_it(tmp_path, key, value) -> None:
    from omlx_core.config import ConfigError

    config = tmp_path / "omlx.toml"
    config.write_text(f'[models.m]\npath = "{tmp_path}"\n{key} = "{value}"\n')
    with pytest.raises(ConfigError) as refused:
        load_setup("cpu-small", [config])
    assert f"models.m.{key}" in str(refused.value) and "auto" in str(refused.value)
