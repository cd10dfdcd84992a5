"""Structured output end to end: OpenAI's response_format through the SDK on a tiny
random-weight model (constraints hold even for a model that knows nothing), errors that
name the field, and constrained rows that leave the other rows of a batch untouched."""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from omlx_core.bootstrap import stop_engines
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.grammar import GrammarSpec
from omlx_core.server_context import ServerContext

from conftest import start_tiny_context

openai = pytest.importorskip("openai")
import jsonschema
from omlx_core.testing import engine_io

MODEL = "tiny"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
}, "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Iterator[ServerContext]:
    context = start_tiny_context(tmp_path_factory, MODEL)
    yield context
    stop_engines(context)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(client, temperature) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"A person, please ({seed})."}],
            max_tokens=200, temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice  # ended by the grammar, not the limit
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_output_is_a_json_object_or_array_streamed_too(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Any JSON."}], max_tokens=300,
        temperature=0.7, seed=5, response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), (dict, list))


def test_a_schema_that_cannot_be_used_is_a_400_naming_the_field(client) -> None:
    for schema, words in (({"type": "object", "properties": {"x": {"type": "nonsense"}}}, ""),
                          (False, "no value satisfies")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "bad", "schema": schema}})
        assert refused.value.body["param"] == "response_format.json_schema.schema"
        assert words in refused.value.body["message"]


def test_constrained_rows_leave_the_others_of_the_batch_unchanged(context) -> None:
    engine = context.engines[MODEL]
    prompts = [engine.tokenize_chat([{"role": "user", "content": f"Item {i}, go on."}])
               for i in range(16)]
    schemas = [GrammarSpec.json_schema({"type": "object", "properties": {
        f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}) for i in range(8)]

    def run(tag: str, constrained: bool) -> list[list[int]]:
        handles = []
        for i, prompt in enumerate(prompts):
            grammar = schemas[i // 2] if constrained and i % 2 == 0 else None
            sampling = SamplingParams(temperature=0.0, max_tokens=12, grammar=grammar)
            handles.append(engine.submit(GenerationRequest(f"{tag}-{i}", prompt, sampling)))
        return [[t for o in engine_io.collect(handle) for t in o.token_ids] for handle in handles]

    engine.prefix_cache.clear()
    free = run("free", False)
    engine.prefix_cache.clear()
    mixed = run("mixed", True)
    assert [mixed[i] for i in range(1, 16, 2)] == [free[i] for i in range(1, 16, 2)]
    assert any(mixed[i] != free[i] for i in range(0, 16, 2))  # the constraint did act


def test_regex_and_ebnf_extensions_constrain_the_whole_output(client) -> None:
    import re

    date = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A date."}], max_tokens=30,
        temperature=1.0, seed=2, response_format={"type": "regex", "regex": r"\d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.choices[0].message.content)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=10,
        temperature=1.0, seed=4, extra_body={"response_format": {
            "type": "grammar", "grammar": 'root ::= "yes" | "no"'}})
    assert answer.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, response_format={
                                           "type": "grammar", "grammar": "root ::= ("})
    assert refused.value.body["param"] == "response_format.grammar"
