"""The default model (SmolLM2-135M-Instruct) asked about the weather with a weather tool,
through both SDKs: the call it returns names the tool and its arguments validate."""

from __future__ import annotations

import json
from typing import Iterator

import jsonschema
import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.server_context import ServerContext

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
          "required": ["city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def context(default_model_dir) -> Iterator[ServerContext]:
    context = start_engines(load_setup("cpu-small"), progress=False)
    yield context
    stop_engines(context)


def test_openai_sdk_gets_a_valid_weather_call(server) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=60, tool_choice="required",
            tools=[{"type": "function", "function": {
                "name": "get_weather", "description": "Get the current weather for a city",
                "parameters": SCHEMA}}])
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMA)
    assert "paris" in arguments["city"].lower()


def test_anthropic_sdk_gets_a_valid_weather_call(server) -> None:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as claude:
        reply = claude.messages.create(
            model=MODEL, max_tokens=60, messages=ASK, extra_body={"temperature": 0},
            tool_choice={"type": "any"}, tools=[{
                "name": "get_weather", "description": "Get the current weather for a city",
                "input_schema": SCHEMA}])
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "get_weather" and reply.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
